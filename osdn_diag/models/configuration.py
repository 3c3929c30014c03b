"""Hugging Face configs of the OSDN / OSGDN language models.

:class:`OSDNConfig` is fla's :class:`~fla.models.DeltaNetConfig` and :class:`OSGDNConfig` fla's
:class:`~fla.models.GatedDeltaNetConfig`, each with the phase-1 arguments of the layers
(:class:`osdn_diag.layers.OSDN`, :class:`osdn_diag.layers.OSGDN`):

* ``eta`` (0.003), ``d_min`` (0.5), ``d_max`` (2.0), ``beta_aware`` (True), ``phase1_eps`` (1e-6),
  ``phase1_method`` ("auto": phase 1's forward kernel);
* ``apf`` (False): learned retention of the preconditioner per token and head;
* ``learn_d0`` (False): learned initial preconditioner per head and key channel.

They are checked here, at construction, with the layers' own checks (a ``ValueError`` naming the
argument), so that a bad config fails before any weight is allocated. Importing this module imports
fla.
"""

from __future__ import annotations

from fla.models.delta_net.configuration_delta_net import DeltaNetConfig
from fla.models.gated_deltanet.configuration_gated_deltanet import GatedDeltaNetConfig

from ..layers._common import check_osdn_args

__all__ = ["OSDN_ARG_NAMES", "OSDNConfig", "OSGDNConfig", "osdn_layer_kwargs"]

#: The config attributes that the OSDN / OSGDN layers take on top of their fla counterparts.
OSDN_ARG_NAMES = ("eta", "d_min", "d_max", "beta_aware", "apf", "learn_d0", "phase1_eps", "phase1_method")


def _set_osdn_args(config, eta, d_min, d_max, beta_aware, apf, learn_d0, phase1_eps, phase1_method) -> None:
    check_osdn_args(eta=eta, d_min=d_min, d_max=d_max, phase1_eps=phase1_eps, phase1_method=phase1_method)
    config.eta = eta
    config.d_min = d_min
    config.d_max = d_max
    config.beta_aware = bool(beta_aware)
    config.apf = bool(apf)
    config.learn_d0 = bool(learn_d0)
    config.phase1_eps = phase1_eps
    config.phase1_method = phase1_method


def osdn_layer_kwargs(config) -> dict:
    """The phase-1 keyword arguments of a layer, read from ``config``."""
    return {name: getattr(config, name) for name in OSDN_ARG_NAMES}


class OSDNConfig(DeltaNetConfig):
    """:class:`~fla.models.DeltaNetConfig` plus the OSDN phase-1 arguments (see the module docstring)."""

    model_type = "osdn"

    def __init__(
        self,
        eta: float = 0.003,
        d_min: float = 0.5,
        d_max: float = 2.0,
        beta_aware: bool = True,
        apf: bool = False,
        learn_d0: bool = False,
        phase1_eps: float = 1e-6,
        phase1_method: str = "auto",
        **kwargs,
    ):
        _set_osdn_args(self, eta, d_min, d_max, beta_aware, apf, learn_d0, phase1_eps, phase1_method)
        super().__init__(**kwargs)


class OSGDNConfig(GatedDeltaNetConfig):
    """:class:`~fla.models.GatedDeltaNetConfig` plus the OSDN phase-1 arguments (see the module
    docstring). ``num_v_heads`` must be ``None`` or a multiple of ``num_heads`` (checked by the layer)."""

    model_type = "osgdn"

    def __init__(
        self,
        eta: float = 0.003,
        d_min: float = 0.5,
        d_max: float = 2.0,
        beta_aware: bool = True,
        apf: bool = False,
        learn_d0: bool = False,
        phase1_eps: float = 1e-6,
        phase1_method: str = "auto",
        **kwargs,
    ):
        _set_osdn_args(self, eta, d_min, d_max, beta_aware, apf, learn_d0, phase1_eps, phase1_method)
        super().__init__(**kwargs)
