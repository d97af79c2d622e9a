"""``PRESET[,field=value,...]`` parameter specs of the generated workloads (``shared-prefix:SPEC``,
``conversations:SPEC``): one parser, so every generator reads and rejects specs alike."""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import WorkloadError

P = TypeVar("P", bound=BaseModel)


def parse_generator_spec(
    what: str, spec: str, presets: Mapping[str, tuple[P, int]], default_preset: str, model: type[P]
) -> tuple[str, P, int]:
    """Parse ``PRESET``, ``PRESET,field=value,...`` or ``field=value,...`` (empty: ``default_preset``)
    into the preset's parameters with the overrides validated by ``model``.

    Args:
        what: the generator's name, for messages (``shared-prefix``).
        presets: preset name -> (parameters, the preset's default request count).

    Returns:
        ``(preset name, parameters, the preset's default request count)``.

    Raises:
        WorkloadError: unknown preset, a field that does not exist, a malformed item or an
            invalid value (one line, naming the item).
    """
    items = [s.strip() for s in spec.split(",")] if spec.strip() else []
    preset = default_preset
    if items and "=" not in items[0]:
        preset = items.pop(0)
        if preset not in presets:
            raise WorkloadError(f"unknown {what} preset {preset!r}; valid: {', '.join(sorted(presets))}")
    base, default_n = presets[preset]
    overrides: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise WorkloadError(f"{what} option {item!r} is not field=value (or a preset first)")
        if key not in model.model_fields:
            raise WorkloadError(f"{what} option {key!r} is not a parameter; valid: {', '.join(model.model_fields)}")
        overrides[key] = value.strip()
    try:
        params = model.model_validate({**base.model_dump(), **overrides})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "?"
        raise WorkloadError(f"{what} option {field}={overrides.get(field, '')!r}: {err['msg']}") from None
    return preset, params, default_n
