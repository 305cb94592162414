"""A loopback smol cloud: the part of the smol cloud REST API the smol backend uses, on 127.0.0.1.

Run ``python -m tests.smolcloud`` from the repository root; the first line on stdout is
``SMOL_CLOUD_URL=http://127.0.0.1:PORT``. Point the SDK at it with that variable and any
non-empty ``SMOL_CLOUD_TOKEN``. Machines are this project's namespace guests, so the real
SDK and the real smol backend run end to end on a host where no microVM boots.
"""
