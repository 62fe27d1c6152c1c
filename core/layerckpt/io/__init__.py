"""The bottom of the engine: bytes to and from a file descriptor.

Its part: the I/O backends (the native io_uring ring, the threads pool), CRC32C, byte units and the O_DIRECT
alignment. ``_backend`` is the one module that imports the native extension ``_uring``; whatever else wants native
code (the encoder's byte planes) asks ``_backend`` for it, so that a machine without the extension has one place to
fall back.

Invariants: knows nothing of checkpoints, manifests or layers; never blocks on anything but the kernel.
May import: nothing of the package but ``layerckpt.errors``.
"""
