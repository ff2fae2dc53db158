"""The checkpoint image: core.img records (core.py), checksums and the manifest."""
