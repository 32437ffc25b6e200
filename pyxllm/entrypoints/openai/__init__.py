"""The OpenAI-compatible HTTP API: ``api_server.build_app`` / ``api_server.run_server``."""
