"""The planner (search/, model_specs/ data, the aceso CLI) imports and runs with torch and megatron blocked."""

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('torch', 'megatron', 'transformer_engine', 'apex'):
                raise ImportError(f'blocked import of {name}')
    sys.meta_path.insert(0, Block())
""")


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], cwd=ROOT,
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
        assert 'search.cli' in names and 'search.plan' in names
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
