"""The vLLM recipe in the docs, parsed by vLLM 0.33's own code from its PyPI wheel.

`--kv-transfer-config` goes through the same steps as in `vllm serve` (arg_utils:
human-readable numbers expanded, then pydantic's `TypeAdapter(KVTransferConfig)
.validate_json`), with `KVTransferConfig` and the `config` decorator taken from the
wheel. The connector, spec and tier names are checked against the registrations in
vLLM's factories, and the `fs` tier's keys against its manager's constructor, read
from the same wheel (without importing torch and the rest of vLLM's dependencies).
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

VLLM_VERSION = "0.33.0"
WHEEL_CACHE = Path("/var/cache/kvfs/wheels")  # downloaded once (336 MB), like the test VM's image
DOCS = [Path(__file__).parent.parent / "README.md", Path(__file__).parent.parent / "docs" / "operations.md"]


@pytest.fixture(scope="module")
def wheel() -> Iterator[zipfile.ZipFile]:
    found = sorted(WHEEL_CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not found:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(WHEEL_CACHE), f"vllm=={VLLM_VERSION}"], check=True, timeout=1800)
        found = sorted(WHEEL_CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    with zipfile.ZipFile(found[0]) as archive:
        yield archive


def source(wheel: zipfile.ZipFile, path: str) -> str:
    return wheel.read(path).decode()


def functions(wheel: zipfile.ZipFile, path: str, names: set[str], namespace: dict) -> dict:
    """Runs the named top-level functions of a vLLM module (their code, not the module's imports)."""
    tree = ast.parse(source(wheel, path))
    picked = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {node.name for node in picked} == names, f"{path} no longer defines {names}"
    module = ast.Module(body=picked, type_ignores=[])
    exec(compile(module, f"{wheel.filename}/{path}", "exec"), namespace)
    return namespace


def registered(wheel: zipfile.ZipFile, path: str, method: str) -> dict[str, tuple[str, str]]:
    """name -> (module, class) of every `Factory.<method>("name", "module", "Class")` call."""
    found = {}
    for node in ast.walk(ast.parse(source(wheel, path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method:
            name, module, cls = (arg.value for arg in node.args[:3])  # type: ignore[attr-defined]
            found[name] = (module, cls)
    return found


def constructor_parameters(wheel: zipfile.ZipFile, path: str, cls: str) -> list[str]:
    for node in ast.walk(ast.parse(source(wheel, path))):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            init = next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__")
            return [arg.arg for arg in init.args.args[1:] + init.args.kwonlyargs]
    raise AssertionError(f"no class {cls} in {path}")


@pytest.fixture
def KVTransferConfig(wheel: zipfile.ZipFile) -> Iterator[type]:
    """vLLM's KVTransferConfig, made by vLLM's own `config` decorator (a pydantic dataclass that
    forbids unknown keys). Stand-ins only for what the recipe does not reach: the hash helper
    (compute_hash is not called) and the platform (the kv_buffer_device default: CUDA)."""
    from pydantic import ConfigDict
    from pydantic.dataclasses import dataclass

    utils = types.ModuleType("vllm.config.utils")
    hashing = types.ModuleType("vllm.utils.hashing")
    hashing.safe_hash = None  # type: ignore[attr-defined]
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(device_type="cuda")  # type: ignore[attr-defined]
    namespace = functions(wheel, "vllm/config/utils.py", {"config"},
                          {"ConfigDict": ConfigDict, "dataclass": dataclass, "Any": object,
                           "dataclass_transform": lambda **_: (lambda f: f), "PydanticField": None,
                           "overload": lambda f: f})
    utils.config = namespace["config"]  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("vllm", "vllm.config", "vllm.config.utils",
                                                       "vllm.utils", "vllm.utils.hashing", "vllm.platforms")}
    sys.modules.update({"vllm": types.ModuleType("vllm"), "vllm.config": types.ModuleType("vllm.config"),
                        "vllm.config.utils": utils, "vllm.utils": types.ModuleType("vllm.utils"),
                        "vllm.utils.hashing": hashing, "vllm.platforms": platforms})
    try:
        module = types.ModuleType("vllm.config.kv_transfer")
        sys.modules[module.__name__] = module
        exec(compile(source(wheel, "vllm/config/kv_transfer.py"), "vllm/config/kv_transfer.py", "exec"),
             module.__dict__)
        yield module.KVTransferConfig  # parsed while the stand-ins are there (defaults import them)
    finally:
        sys.modules.pop("vllm.config.kv_transfer", None)
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def documented_commands() -> list[tuple[Path, list[str]]]:
    """Every `vllm serve` command line in the docs' shell blocks, split as a shell would."""
    commands = []
    for doc in DOCS:
        for block in re.findall(r"```sh\n(.*?)```", doc.read_text(), re.S):
            joined = block.replace("\\\n", " ")
            for line in re.split(r"\n(?=\S)", joined):
                if line.lstrip().startswith("vllm serve"):
                    commands.append((doc, shlex.split(line, comments=True)))
    return commands


def test_the_vllm_recipe_parses_with_vllms_own_config_classes(wheel: zipfile.ZipFile, KVTransferConfig: type) -> None:
    commands = documented_commands()
    assert {doc.name for doc, _ in commands} == {"README.md", "operations.md"}, commands
    from pydantic import TypeAdapter

    expand = functions(wheel, "vllm/engine/arg_utils.py", {"_expand_json_human_readable_numbers"},
                       functions(wheel, "vllm/utils/argparse_utils.py", {"human_readable_int"},
                                 {"re": re, "argparse": __import__("argparse")}))
    assert "--kv-transfer-config" in source(wheel, "vllm/engine/arg_utils.py")
    connectors = registered(wheel, "vllm/distributed/kv_transfer/kv_connector/factory.py", "register_connector")
    specs = registered(wheel, "vllm/v1/kv_offload/factory.py", "register_spec")
    tiers = registered(wheel, "vllm/v1/kv_offload/tiering/factory.py", "register_tier")
    for doc, argv in commands:
        assert argv[:2] == ["vllm", "serve"] and not argv[2].startswith("-"), (doc, argv)
        value = argv[argv.index("--kv-transfer-config") + 1]
        parsed = TypeAdapter(KVTransferConfig).validate_json(expand["_expand_json_human_readable_numbers"](value))
        assert parsed.kv_connector in connectors and parsed.kv_connector == "OffloadingConnector", doc
        assert parsed.is_kv_producer and parsed.is_kv_consumer, doc
        extra = parsed.kv_connector_extra_config
        assert extra["spec_name"] in specs and extra["spec_name"] == "TieringOffloadingSpec", doc
        assert isinstance(extra["cpu_bytes_to_use"], int) and extra["cpu_bytes_to_use"] >= 1 << 30, doc
        assert "cpu_bytes_to_use" in source(wheel, "vllm/v1/kv_offload/cpu/spec.py")
        [tier] = extra["secondary_tiers"]
        module, cls = tiers[tier["type"]]
        assert tier["type"] == "fs" and tier["root_dir"] == "/mnt/kvfs", doc
        parameters = constructor_parameters(wheel, module.replace(".", "/") + ".py", cls)
        # The factory passes the tier's keys, less `type`, to the constructor with these three.
        assert parameters[:3] == ["offloading_spec", "primary_kv_view", "tier_type"], parameters
        assert set(tier) - {"type"} <= set(parameters[3:]), (doc, tier, parameters)


def test_a_wrong_key_is_refused_by_the_same_parse(KVTransferConfig: type) -> None:
    from pydantic import TypeAdapter, ValidationError

    with pytest.raises(ValidationError, match="kv_conector"):
        TypeAdapter(KVTransferConfig).validate_json('{"kv_conector": "OffloadingConnector", "kv_role": "kv_both"}')
    with pytest.raises(ValidationError, match="kv_role"):
        TypeAdapter(KVTransferConfig).validate_json('{"kv_connector": "OffloadingConnector"}')
