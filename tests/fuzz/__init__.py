"""Hostile clients for ``tests/entrypoints/openai/test_fuzz.py``,
``tests/entrypoints/openai/test_load.py`` and ``benchmarks/soak.py``: the corpus's data
(``corpus.json``: prompts, constraints, wrong values per type, extreme numbers, routes) and its
generators (:mod:`.cases`), the judges of the answers (:mod:`.checks`), the senders and the
load test's clients (:mod:`.clients`), and the Responses and Messages APIs' shares
(:mod:`.responses`, :mod:`.messages`).

- :func:`generate_cases`: a seeded corpus of HTTP requests over every route and field of the
  server (valid ones and faulty ones: wrong types, out-of-range and extreme numbers, invalid
  Unicode, empty and huge strings, deep nesting, wrong content types, invalid JSON, limits,
  combinations, streamed and not), each with what a correct server must answer
  (:class:`Expect`). Requests are cheap: ``max_tokens`` 1-4, ``n`` at most 3, short prompts
  (except the few ``n`` far above any bound, in :func:`bound_cases`).
- :func:`run_cases` sends them concurrently and :func:`check_case` judges each answer: no 5xx,
  no dropped connection, the status expected, every 4xx in OpenAI's error shape naming the
  expected ``param`` (a ``kind="messages"`` case's in Anthropic's shape, its message naming the
  field: :func:`check_anthropic_error_body`, :func:`message_names`), well-formed JSON and SSE
  without NaN or Infinity.
- :func:`stream_client` and the raw-socket slow and broken clients (:func:`trickled_body`,
  :func:`short_body_then_close`, :func:`idle_sockets`, :func:`unread_stream`) of the load test.

Which fault must name which ``param`` (:class:`Expect`, prefix match: ``messages`` matches
``messages[0].content``, ``response_format`` matches ``response_format.json_schema.schema``):

- a wrong type, an out-of-range value, an unsupported value, too many or too long items of
  one field (``stop``, ``messages``, ``logit_bias``, ``prompt`` lists), nesting too deep
  under one field, a lone surrogate written as a JSON escape (``"\\udfff"``) in one field:
  that top-level field (an unknown field's own name, e.g. ``metadata``);
- a top-level field the server does not know (:data:`UNKNOWN_FIELDS`): a 400 naming it, or the
  field of the case's other fault, whichever is checked first;
- two output constraints: either of them; a tool fault: ``tools`` or ``tool_choice``;
- what fails as the body is parsed, before any field is known: raw invalid UTF-8 bytes in a
  string, ``NaN``/``Infinity`` literals (not JSON), a 5000-digit integer, nesting beyond what
  Python's parser takes: a 400 (413) naming the field or no ``param``;
- invalid JSON, a body that is not an object, a wrong content type, unknown routes, wrong
  methods, a body over the size limit: any ``param``;
- values a server may serve or refuse (``seed`` in [2**63, 2**64), ``repetition_penalty``
  1e-45, huge schemas, "3" for an int...): a 200, or a 400 naming the field.
"""
