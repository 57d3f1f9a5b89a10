"""Config building stays on its floor: it sizes GGUF blocks from the loader, never the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridllm

PACKAGE = Path(hybridllm.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_config_building_never_imports_the_layers_models_or_workers():
    for name in ("config.py", "engine_args.py", "engine_flags.py", "loader/block_sizes.py"):
        upstairs = {
            m
            for m in imported_modules(PACKAGE / name)
            if m.startswith(("hybridllm.layers", "hybridllm.worker"))
        }
        assert upstairs == set(), name


def test_the_layers_never_import_the_plan():
    for path in sorted((PACKAGE / "layers").glob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        plan = {m for m in imported_modules(path) if m.startswith("hybridllm.plan")}
        assert plan == set(), name


def test_block_sizes_need_the_kernels_only_where_there_are_blocks():
    from hybridllm.loader import default_model_path, open_model_source
    from hybridllm.loader.block_sizes import cpu_block_sizes

    source = open_model_source(default_model_path())  # Q4_1 linears, a tied Q8_0 embedding
    config = source.hf_config
    asked = []

    def kernels(answer: bool):
        return lambda: asked.append(answer) or answer

    assert cpu_block_sizes(source, config, "none", kernels(True)) is None and asked == []
    assert cpu_block_sizes(source, config, "auto", kernels(False)) is None
    sizes = cpu_block_sizes(source, config, "auto", kernels(True))
    assert sizes is not None and sizes.kept_params == sizes.total_params
    assert asked == [False, True]
