"""Chat Completions (``/v1/chat/completions``) and what the Responses and Messages APIs reuse
from it: choices, tools and tool parsers, reasoning parsers, harmony."""
