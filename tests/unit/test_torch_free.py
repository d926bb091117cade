"""The planner (search/, model_specs/ data, the aceso CLI) imports and runs with torch and megatron blocked, and
never imports, nor even names, the runtime (``aceso_megatron``): the dependency direction is search <- runtime."""

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = {blocked!r}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in BLOCKED:
                raise ModuleNotFoundError(f'blocked import of {{name}}', name=name)
    sys.meta_path.insert(0, Block())
""")
TORCH = ("torch", "megatron", "transformer_engine", "apex")


def run_blocked(code: str, blocked: tuple[str, ...] = TORCH) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER.format(blocked=blocked) + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_blocker_really_blocks():
    r = run_blocked("import torch")
    assert r.returncode != 0 and "blocked import of torch" in r.stderr


def test_every_search_module_imports_without_torch():
    r = run_blocked("""
        import importlib, pkgutil, search, model_specs
        names = [m.name for m in pkgutil.walk_packages(search.__path__, 'search.') if not m.name.endswith('__main__')]
        for n in names:
            importlib.import_module(n)
        assert 'search.cli' in names and 'search.spec.plan' in names
        print(len(names))
    """)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) >= 10


def test_cli_runs_without_torch():
    r = run_blocked("""
        import sys
        from search.cli import main
        assert main(['models', '--json']) == 0
        assert main(['clusters', '--json']) == 0
    """)
    assert r.returncode == 0, r.stderr
    assert '"gpt-1.3b"' in r.stdout


def test_every_search_module_imports_without_the_runtime():
    """Every module under search/ (walked, not listed) with aceso_megatron, torch and megatron blocked."""
    r = run_blocked("""
        import importlib, pkgutil, sys, search
        names = [m.name for m in pkgutil.walk_packages(search.__path__, 'search.') if not m.name.endswith('__main__')]
        for n in names:
            importlib.import_module(n)
        assert not [m for m in sys.modules if m.split('.')[0] in ('aceso_megatron', 'torch', 'megatron')]
        print(len(names))
    """, blocked=("aceso_megatron", *TORCH))
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) >= 10


def test_planner_cli_runs_without_the_runtime():
    """A planner-only install: planner subcommands work; a runtime one says how to install it, exit 2."""
    r = run_blocked("""
        from search.cli import main
        assert main(['models', '--json']) == 0
        assert main(['train', 'plan.json']) == 2
    """, blocked=("aceso_megatron", *TORCH))
    assert r.returncode == 0, r.stderr
    assert 'pip install -e ".[runtime]"' in r.stderr and r.stderr.count("\n") == 1


def test_search_never_names_the_runtime():
    """The product rule: no file under search/ contains the runtime's package name."""
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "search").rglob("*"))
                 if p.is_file() and p.suffix != ".pyc" and "aceso_megatron" in p.read_text(errors="ignore")]
    assert offenders == []
