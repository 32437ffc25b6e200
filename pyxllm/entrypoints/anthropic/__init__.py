"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), served
by the OpenAI chat completions code (see :mod:`.serving_messages`)."""
