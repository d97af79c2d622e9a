"""Phasewise operator: LLMRouterPool and LLMRouterJob (``phasewise.io/v1alpha1``) with kopf.

Run with ``python -m phasewise_operator`` (settings: :mod:`phasewise_operator.settings`).
Modules: :mod:`~phasewise_operator.gen_crds` (the CRDs), :mod:`~phasewise_operator.spec`
(typed specs and checks), :mod:`~phasewise_operator.builders` and
:mod:`~phasewise_operator.jobs` (desired objects, pure), :mod:`~phasewise_operator.status`
(status, pure), :mod:`~phasewise_operator.kube` (the only API client),
:mod:`~phasewise_operator.reconcile` (the control loop), :mod:`~phasewise_operator.handlers`
(kopf wiring), :mod:`~phasewise_operator.report` (a job pod's result reporter).
"""

from phasewise_operator.settings import OPERATOR_VERSION as __version__

__all__ = ["__version__"]
