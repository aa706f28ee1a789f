"""What fit() ships to the workers: user classes the workers can import arrive as themselves, not copies."""

from __future__ import annotations

import importlib
import sys

import pytest

from ray_elastic.shipping import importable_from, pack, unpack


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's own module `usermod_payload` in the working directory (which Ray puts on the workers' path)."""
    (tmp_path / "usermod_payload.py").write_text("class Thing:\n    def __init__(self, n):\n        self.n = n\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("usermod_payload")
    yield module
    sys.modules.pop("usermod_payload", None)


def test_a_module_in_the_workers_path_is_importable_there(user_module, tmp_path):
    assert importable_from(user_module, [str(tmp_path)])
    assert not importable_from(user_module, [str(tmp_path / "elsewhere")])


def test_an_importable_user_class_arrives_as_the_same_class(user_module):
    thing = unpack(pack({"thing": user_module.Thing(3)}))["thing"]
    assert type(thing) is user_module.Thing and thing.n == 3


def test_where_the_module_does_not_import_the_by_value_copy_is_used(user_module, tmp_path, monkeypatch):
    data = pack(user_module.Thing(5))
    sys.modules.pop("usermod_payload")
    monkeypatch.syspath_prepend(str(tmp_path / "nothing-here"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    monkeypatch.chdir(tmp_path.parent)
    thing = unpack(data)
    assert thing.n == 5 and type(thing).__name__ == "Thing"
    assert "usermod_payload" not in sys.modules, "the copy came by value, without importing the module"


def test_a_module_the_workers_cannot_import_travels_by_value(tmp_path, monkeypatch):
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "usermod_helper.py").write_text("def f():\n    return 42\n")
    monkeypatch.syspath_prepend(str(helpers))
    module = importlib.import_module("usermod_helper")
    try:
        data = pack(module.f)
        sys.modules.pop("usermod_helper")
        monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(helpers)])
        assert unpack(data)() == 42
    finally:
        sys.modules.pop("usermod_helper", None)


def test_something_else_is_not_taken_for_a_payload():
    import cloudpickle

    with pytest.raises(ValueError, match="not a ray-elastic payload"):
        unpack(cloudpickle.dumps(("other", b"", None)))


class _NotAModule:
    """What some packages put into `sys.modules`: an object with no `__name__` (seen beside Lightning on a GPU)."""

    def __getattr__(self, name: str):
        raise AttributeError(name)


def test_an_object_in_sys_modules_that_is_not_a_module_does_not_stop_fit(user_module, monkeypatch):
    monkeypatch.setitem(sys.modules, "a_package._not_a_module", _NotAModule())
    thing = unpack(pack(user_module.Thing(7)))
    assert type(thing) is user_module.Thing and thing.n == 7
