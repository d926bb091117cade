"""`aceso profile -o db.json` as a user meets it (issue "Right answers", user audit 2): the database a team shares
gets the permissions every other output gets (the umask's, as `aceso search -o` and `--plot` write theirs; a
replaced file keeps its own), not the private 0600 of the temporary file it was renamed from."""

import os
import stat

import pytest

from search.costmodel.profiledb import ProfileDBWriter
from search.spec.model import ModelSpec

TINY = ModelSpec(name="tiny", family="gpt", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                 seq_length=64, vocab_size=512, params_dtype="fp32")


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_database_gets_the_umask_permissions(tmp_path, umask_022):
    out = ProfileDBWriter(TINY, "cpu", "fp32").save(tmp_path / "db.json")
    assert mode(out) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["db.json"]      # no temporary file left beside it


def test_replaced_database_keeps_its_permissions(tmp_path, umask_022):
    db = tmp_path / "db.json"
    db.write_text("{}")
    os.chmod(db, 0o640)
    ProfileDBWriter(TINY, "cpu", "fp32").save(db)
    assert mode(db) == 0o640 and db.read_text().startswith("{")
