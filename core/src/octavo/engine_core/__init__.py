"""The engine core: the scheduler + executor loop, free of tokenization and text.

``EngineCore`` runs one batch per ``step()``; ``core_proc`` runs it in a process of its own
behind the online server (reached from the front end through ``octavo.engine.core_client``).
The front end (``octavo.engine``) sits above this package and is never imported from it.
"""
