"""requirements.lock satisfies pyproject.toml: every requirement of the base dependencies and of the `dev` extra
(the one `make lock` resolves, which holds every other extra's packages) is pinned to a version its specifier
admits, every pin carries sha256 hashes, and torch is left to the Makefile's TORCH step, whose default pin the
base requirement admits. When this fails after a change to pyproject.toml: run `make lock`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
LOCKED_EXTRAS = ("dev",)
LEFT_TO_TORCH_STEP = {"torch"}
ENVIRONMENT = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython"}  # the lock's


def project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def read_lock(text: str) -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, its hashes); raise ValueError for an entry that is not `name==version`."""
    pins: dict[str, tuple[Version, list[str]]] = {}
    entries = re.split(r"\n(?=[A-Za-z0-9])", "\n".join(line for line in text.splitlines()
                                                       if not line.lstrip().startswith("#")))
    for entry in filter(str.strip, entries):
        head = entry.split("\\", 1)[0].split(" --hash")[0].strip()
        requirement = Requirement(head)
        (spec,) = requirement.specifier
        if spec.operator != "==":
            raise ValueError(f"requirements.lock: {head!r} is not pinned with ==")
        name = canonicalize_name(requirement.name)
        if name in pins:
            raise ValueError(f"requirements.lock: {name} is pinned twice")
        pins[name] = (Version(spec.version), re.findall(r"--hash=sha256:([0-9a-f]{64})\b", entry))
    return pins


def requirements(extras=LOCKED_EXTRAS) -> list[Requirement]:
    """The base requirements and those of `extras` that apply on the lock's platform."""
    spec = project()
    found = [Requirement(r) for r in spec["dependencies"]]
    for extra in extras:
        found += [Requirement(r) for r in spec["optional-dependencies"][extra]]
    return [r for r in found if r.marker is None or r.marker.evaluate({**ENVIRONMENT, "extra": ""})]


def unmet(pins: dict, wanted: list[Requirement]) -> list[str]:
    """What the lock lacks for `wanted`: a requirement that is not pinned, or pinned outside its specifier."""
    problems = []
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        if name in LEFT_TO_TORCH_STEP:
            continue
        if name not in pins:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(pins[name][0], prereleases=True):
            problems.append(f"{requirement} is pinned to {pins[name][0]}")
    return problems


def test_the_lock_satisfies_pyproject():
    pins = read_lock(LOCK.read_text(encoding="utf-8"))
    assert unmet(pins, requirements()) == [], "run `make lock`"
    assert not LEFT_TO_TORCH_STEP & set(pins)  # torch comes from TORCH (CPU or a CUDA build), never the lock
    assert [n for n in pins if n.startswith(("nvidia-", "triton", "cuda-"))] == []  # nor a CUDA build's own
    assert [name for name, (_, hashes) in pins.items() if not hashes] == []
    assert len(pins) > 100  # the transitive closure, not only the direct requirements


def test_every_extra_is_inside_the_locked_ones():
    """`make lock` resolves the dev extra: each other extra's packages must be among it, or the lock misses them."""
    spec = project()
    locked = {canonicalize_name(r.name) for r in requirements()}
    for extra, listed in spec["optional-dependencies"].items():
        assert {canonicalize_name(Requirement(r).name) for r in listed} <= locked, extra


def test_the_torch_step_installs_a_torch_the_project_admits():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    default = re.search(r"^TORCH \?= (\S+)", makefile, re.M).group(1)
    (torch,) = [r for r in requirements(()) if r.name == "torch"]
    assert torch.specifier.contains(next(iter(Requirement(default).specifier)).version)
    assert f"--extra {LOCKED_EXTRAS[0]}" in makefile and "--require-hashes" in makefile


def test_a_lock_that_does_not_fit_is_refused():
    """The checks fail on a stale lock: a missing package, a pin outside its range, a pin without hashes."""
    text = LOCK.read_text(encoding="utf-8")
    pins = read_lock(text)
    wanted = requirements()
    transformers = pins["transformers"]
    stale = {name: pin for name, pin in pins.items() if name != "transformers"}
    assert unmet(stale, wanted) == [next(f"{r} is not in the lock" for r in wanted if r.name == "transformers")]
    old = {**pins, "transformers": (Version("4.0.0"), transformers[1])}
    assert unmet(old, wanted) == [next(f"{r} is pinned to 4.0.0" for r in wanted if r.name == "transformers")]
    assert read_lock("click==8.1.0\n")["click"][1] == []
    with pytest.raises(ValueError, match="is not pinned with =="):
        read_lock("click>=8.1 \\\n    --hash=sha256:" + "0" * 64 + "\n")
