"""``phasewise epp``: routerd as a Gateway API Inference Extension endpoint picker.

:mod:`routerd.epp.server` is the Envoy ext_proc front over routerd's
:class:`~routerd.daemon.app.Daemon` (the same router, bookkeeping, predictor, prefix identity
and policies as ``phasewise serve``); :mod:`routerd.epp.envoy_config` builds the Envoy
bootstrap Phasewise ships for standalone mode; :mod:`routerd.epp.cli` is the command.
"""
