"""The OpenAI-compatible HTTP server (``octavo serve``); see ``api_server``."""
