"""All traffic between workers: the communicator (``communicator``), its transports (``transport``;
between sites with kits, the TLS mesh of ``mesh`` and ``tls``), secure aggregation (``secure_agg``),
byte log (``log``), codecs (``codec``, ``sparse_codec``) and the network model (``network``).

Nothing is imported here, so that the torch-free modules (the network model) load without torch.
"""
