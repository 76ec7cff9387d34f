"""Model path confinement and file checks (broker/config/roots.py): every refusal names its cause;
confine returns the real path, the file a worker then loads."""
from __future__ import annotations

import hashlib

import pytest

from conftest import unloaded_model
from tgw.broker import config
from tgw.broker.config import roots
from tgw.broker.config.roots import ModelFileError, PathRefused, check_file, confine, file_sha256


@pytest.fixture
def tree(tmp_path):
    """root/ holding a.pt and sub/b.pt, root2/ (a name that extends root's), outside/c.pt."""
    base = tmp_path.resolve()
    for rel in ("root/a.pt", "root/sub/b.pt", "root2/a.pt", "outside/c.pt"):
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        unloaded_model(base / rel, rel.encode())
    return base


def refused(path, roots) -> str:
    with pytest.raises(PathRefused) as info:
        confine(str(path), [str(r) for r in roots])
    return str(info.value)


# ---- confine -------------------------------------------------------------------------------------

def test_a_path_inside_a_root_is_returned_as_its_real_path(tree):
    assert confine(str(tree / "root" / "a.pt"), [str(tree / "root")]) == str(tree / "root" / "a.pt")
    assert confine(str(tree / "root" / "./sub//b.pt"), [str(tree / "root")]) == str(tree / "root" / "sub" / "b.pt")


def test_any_of_several_roots_will_do(tree):
    roots = [str(tree / "root"), str(tree / "outside")]
    assert confine(str(tree / "outside" / "c.pt"), roots) == str(tree / "outside" / "c.pt")


def test_a_missing_file_inside_a_root_is_confined_not_checked(tree):
    assert confine(str(tree / "root" / "new.pt"), [str(tree / "root")]) == str(tree / "root" / "new.pt")


def test_a_relative_path_is_refused(tree):
    assert "root/a.pt must be absolute" in refused("root/a.pt", [tree / "root"])


def test_dotdot_is_refused_even_when_it_stays_inside(tree):
    msg = refused(f"{tree}/root/sub/../a.pt", [tree / "root"])
    assert msg == f"{tree}/root/sub/../a.pt contains '..'"
    assert "contains '..'" in refused(f"{tree}/root/../outside/c.pt", [tree / "root"])


def test_a_path_outside_every_root_is_refused(tree):
    msg = refused(tree / "outside" / "c.pt", [tree / "root", tree / "root2"])
    assert msg == f"{tree}/outside/c.pt is outside model_roots [{tree}/root, {tree}/root2]"
    assert "is outside model_roots" in refused("/etc/passwd", [tree / "root"])


def test_a_root_whose_name_is_a_prefix_does_not_contain_its_sibling(tree):
    assert "is outside model_roots" in refused(tree / "root2" / "a.pt", [tree / "root"])


def test_a_symlinked_file_escaping_its_root_is_refused(tree):
    link = tree / "root" / "link.pt"
    link.symlink_to(tree / "outside" / "c.pt")
    msg = refused(link, [tree / "root"])
    assert msg == f"{link} is a symlink that resolves to {tree}/outside/c.pt, outside model_roots [{tree}/root]"


def test_a_symlinked_folder_escaping_its_root_is_refused(tree):
    (tree / "root" / "elsewhere").symlink_to(tree / "outside", target_is_directory=True)
    msg = refused(tree / "root" / "elsewhere" / "c.pt", [tree / "root"])
    assert f"is a symlink that resolves to {tree}/outside/c.pt" in msg


def test_a_symlink_within_its_root_is_followed(tree):
    link = tree / "root" / "current.pt"
    link.symlink_to(tree / "root" / "sub" / "b.pt")
    assert confine(str(link), [str(tree / "root")]) == str(tree / "root" / "sub" / "b.pt")


def test_a_root_reached_through_a_symlink_holds_its_real_files(tree):
    (tree / "models").symlink_to(tree / "root", target_is_directory=True)
    assert confine(str(tree / "models" / "a.pt"), [str(tree / "models")]) == str(tree / "root" / "a.pt")
    assert confine(str(tree / "root" / "a.pt"), [str(tree / "models")]) == str(tree / "root" / "a.pt")


def test_no_roots_confine_everything_out(tree):
    assert "is outside model_roots []" in refused(tree / "root" / "a.pt", [])


def test_the_filesystem_root_holds_every_path(tree):
    assert confine(str(tree / "outside" / "c.pt"), ["/"]) == str(tree / "outside" / "c.pt")


# ---- check_file ----------------------------------------------------------------------------------

def file_error(path, sha256=None, fmt=None) -> ModelFileError:
    with pytest.raises(ModelFileError) as info:
        check_file(str(path), sha256, fmt)
    return info.value


def test_a_regular_file_passes_with_and_without_its_sha256(tree):
    path = tree / "root" / "a.pt"
    assert check_file(str(path), None) == "torchscript"     # its format, read from the file
    assert check_file(str(path), hashlib.sha256(path.read_bytes()).hexdigest()) == "torchscript"


def test_a_file_of_another_format_than_declared_is_refused_by_name(tree):
    path = tree / "root" / "a.pt"
    err = file_error(path, fmt="export")
    assert err.field == "format"
    assert str(err) == f"{path} is declared format: export but is a TorchScript archive (torch.jit.save)"
    path.write_bytes(b"plain bytes")
    err = file_error(path)
    assert err.field == "path" and "is not a zip archive" in str(err)


def test_a_missing_file_is_named(tree):
    err = file_error(tree / "root" / "nope.pt")
    assert (str(err), err.field) == (f"model file not found: {tree}/root/nope.pt", "path")
    assert "model file not found" in str(file_error(tree / "root" / "a.pt" / "x.pt"))  # a file as a folder


def test_a_folder_is_not_a_regular_file(tree):
    err = file_error(tree / "root" / "sub")
    assert (str(err), err.field) == (f"not a regular file: {tree}/root/sub", "path")


def test_a_sha256_mismatch_names_the_actual_digest(tree):
    path = tree / "root" / "a.pt"
    err = file_error(path, "0" * 64)
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (str(err), err.field) == (f"sha256 does not match {path} (sha256 {actual})", "sha256")


def test_an_unreadable_file_is_named(tree, monkeypatch):
    def denied(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(roots, "file_sha256", denied)   # root may read any file: simulate the refusal
    err = file_error(tree / "root" / "a.pt", "0" * 64)
    assert (str(err), err.field) == (f"cannot read model file {tree}/root/a.pt: Permission denied", "path")


def test_config_keeps_exporting_file_sha256(tree):
    path = tree / "root" / "a.pt"
    assert config.file_sha256 is file_sha256
    assert file_sha256(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()
