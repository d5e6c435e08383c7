"""psgd: parameter-server and all-reduce training for networks written in NumPy/CuPy."""

__version__ = "0.1.0"
