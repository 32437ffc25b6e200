"""The Responses API (``/v1/responses``): its models, input and output items, runs."""
