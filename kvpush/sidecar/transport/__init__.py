"""The Transport seam (``base.py``) and its implementations: NIXL (``nixl.py``) and an
in-process fake for unit tests (``fake.py``)."""
