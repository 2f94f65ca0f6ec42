"""Executors run workers: in process today; multiprocess tensor parallel and Ray later."""
