"""Hatch build hook: regenerate the gRPC stubs of proto/ before every build.

The stubs are also committed (so a source checkout runs without a build); the test
``tests/test_proto_stubs.py`` fails when the committed ones drift from the .proto files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ProtoStubsHook(BuildHookInterface):
    """Run routerd.api.codegen (grpcio-tools) when proto/ is present."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        root = Path(self.root)
        if not (root / "proto").is_dir():  # building from an sdist without proto/: keep the stubs
            return
        spec = importlib.util.spec_from_file_location(
            "_phasewise_codegen", root / "routerd" / "routerd" / "api" / "codegen.py")
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)
        codegen.write()
