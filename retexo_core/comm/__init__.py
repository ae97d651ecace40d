"""All traffic between workers: the communicator (``communicator``), its transports (``transport``),
byte log (``log``), codecs (``codec``, ``sparse_codec``) and the network model (``network``).

Nothing is imported here, so that the torch-free modules (the network model) load without torch.
"""
