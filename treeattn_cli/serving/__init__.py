"""A resident engine, from the launching process (``chat``, ``serve``): its ranks
(``engine_client``), the front that feeds them one open batch of typed requests (``front``) and
the documents that front knows (``catalog``). What runs in a rank is ``engine/``."""
