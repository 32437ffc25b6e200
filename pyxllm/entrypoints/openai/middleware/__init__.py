"""What wraps every route: access log, request log, API keys and CORS, size limits."""
