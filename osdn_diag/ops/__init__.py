"""Triton kernels, each beside the plain-torch reference it is tested against (:mod:`osdn_diag.math`)."""
