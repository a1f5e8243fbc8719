"""Checkout-only entry shim for `python -m artifacts` (the code is nxdi_voxtral.release; installed: nxdi-voxtral-artifacts)."""
