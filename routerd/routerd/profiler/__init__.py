"""Measure an OpenAI-compatible endpoint and fit a hardware profile (``phasewise profile``).

:mod:`~routerd.profiler.plan` (what is sent), :mod:`~routerd.profiler.client` (timed
requests), :mod:`~routerd.profiler.measure` (streams to points),
:mod:`~routerd.profiler.fit` (least squares), :mod:`~routerd.profiler.writer`
(profile YAML), :mod:`~routerd.profiler.cli` (the command and
:func:`~routerd.profiler.cli.profile_endpoint`).
"""
