"""Command-line front doors: ``psgd`` (and, with the parameter server, ``psgd-server`` / ``psgd-worker``)."""
