"""A rank's KV as stored: the dtypes and fp8 format of the pool's rows (``kvdtypes``,
``kvquant``), and a document's copies outside the pool: host memory (``host_tier``), disk
(``kvstore``, ``saving``), found and loaded (``copies``)."""
