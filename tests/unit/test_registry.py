"""Registry.validate (broker/models/registry.py), pure: every rule a request header must pass, the code
each refusal carries with its key details, and what an admitted request's Checked holds."""
from __future__ import annotations

import pytest

from conftest import unloaded_model
from tgw.broker.config.load import parse_config
from tgw.broker.models.registry import Registry
from tgw.shm.errors import Code, TgwError
from tgw.shm.wire import Infer, TensorMeta, nbytes_of

MAX_ROWS = 8
FIXED_INPUTS = [{"name": "a", "dtype": "float32", "shape": [2, 3]},
                {"name": "b", "dtype": "int64", "shape": [4]}]
VAR_INPUTS = [{"name": "tokens", "dtype": "int64", "shape": [-1]},
              {"name": "mask", "dtype": "bool", "shape": [2, -1]}]


@pytest.fixture
def reg(tmp_path) -> Registry:
    """"fixed" (versions 1 and 2, only 1 loaded) and "var" (variable dims), both max 8 rows."""
    for name in ("f1.pt", "f2.pt", "v1.pt"):
        unloaded_model(tmp_path / name)
    cfg = parse_config({"models": [
        {"name": "fixed", "versions": [{"version": "1", "path": "f1.pt"}, {"version": "2", "path": "f2.pt"}],
         "default_version": "1", "inputs": FIXED_INPUTS, "max_batch_size": MAX_ROWS,
         "outputs": [{"name": "y", "dtype": "float32", "shape": [2]},
                     {"name": "z", "dtype": "int64", "shape": []}]},
        {"name": "var", "versions": [{"version": "1", "path": "v1.pt"}], "inputs": VAR_INPUTS,
         "outputs": [{"name": "logits", "dtype": "float16", "shape": [-1, 3]}], "max_batch_size": MAX_ROWS},
    ]}, base_dir=str(tmp_path))
    r = Registry(cfg.models)
    r.models["fixed"].records["1"].seen = True   # as a worker's ready message marks them
    r.models["var"].records["1"].seen = True
    return r


def metas(decls: list[dict], rows: int = 2, dims: tuple = (5, 7), **changes) -> list[TensorMeta]:
    """One TensorMeta per declared input (-1 dims taken from `dims` in turn); `changes` maps an
    input name to the fields to override on its meta."""
    free = iter(dims)
    out = []
    for d in decls:
        shape = [rows, *(next(free) if n == -1 else n for n in d["shape"])]
        fields = {"name": d["name"], "dtype": d["dtype"], "shape": shape, **changes.get(d["name"], {})}
        out.append(TensorMeta(**fields))
    return out


def infer(model: str = "fixed", inputs: list[TensorMeta] | None = None, **fields) -> Infer:
    if inputs is None:
        inputs = metas(VAR_INPUTS if model == "var" else FIXED_INPUTS)
    return Infer(v=1, id=1, model=model, inputs=inputs, **fields)


def frames_for(req: Infer) -> list[int]:
    """The frame sizes an honest client sends (shapes with a negative dim get 0)."""
    return [max(nbytes_of(t.dtype, t.shape), 0) for t in req.inputs]


def check(reg: Registry, req: Infer, frames: list[int] | None = None):
    return reg.validate(req, frames_for(req) if frames is None else frames)


def refused(reg: Registry, req: Infer, frames: list[int] | None = None) -> TgwError:
    with pytest.raises(TgwError) as info:
        check(reg, req, frames)
    return info.value


# ---- model and version -------------------------------------------------------------------------

def test_model_not_found_lists_available(reg):
    err = refused(reg, infer("nope"))
    assert err.code is Code.MODEL_NOT_FOUND
    assert err.details["model"] == "nope" and err.details["available"] == ["fixed", "var"]


def test_version_not_found(reg):
    err = refused(reg, infer(version="9"))
    assert err.code is Code.VERSION_NOT_FOUND
    assert err.details["version"] == "9" and err.details["available"] == ["1", "2"]


def test_declared_version_not_ready_until_loaded(reg):
    err = refused(reg, infer(version="2"))
    assert err.code is Code.MODEL_NOT_READY and err.retryable
    assert err.details == {"model": "fixed", "version": "2"}
    reg.models["fixed"].records["2"].seen = True
    assert check(reg, infer(version="2")).version == "2"


def test_no_version_means_the_default(reg):
    assert check(reg, infer()).version == "1"
    for rec in reg.models["fixed"].records.values():
        rec.seen = False
    assert refused(reg, infer()).code is Code.MODEL_NOT_READY


def test_negative_timeout_refused_zero_accepted(reg):
    err = refused(reg, infer(timeout_ms=-1))
    assert err.code is Code.INVALID_ARGUMENT and err.details["timeout_ms"] == -1
    check(reg, infer(timeout_ms=0))


# ---- inputs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("frames", [[24 * 4], [24 * 4, 8 * 8, 0]], ids=["fewer", "more"])
def test_frame_count_must_match_tensor_count(reg, frames):
    assert refused(reg, infer(), frames).code is Code.INVALID_ARGUMENT


@pytest.mark.parametrize("names", [["a"], ["a", "b", "c"], ["a", "a"], ["a", "b", "b"], ["a", "x"]],
                         ids=["missing", "extra", "duplicate", "duplicate-extra", "unknown"])
def test_input_names_must_be_exactly_the_declared_ones(reg, names):
    decls = {d["name"]: d for d in FIXED_INPUTS}
    inputs = metas([{**decls.get(n, FIXED_INPUTS[1]), "name": n} for n in names])
    err = refused(reg, infer(inputs=inputs))
    assert err.code is Code.INVALID_ARGUMENT
    want = {"expected": ["a", "b"], "input": "x"} if names == ["a", "x"] else {"expected": ["a", "b"], "got": names}
    assert err.details == want


def test_dtype(reg):
    err = refused(reg, infer(inputs=metas(FIXED_INPUTS, b={"dtype": "int32"})))
    assert err.code is Code.INVALID_INPUT_DTYPE
    assert err.details == {"input": "b", "expected": "int64", "got": "int32"}


@pytest.mark.parametrize("shape", [[2, 6], [2, 2, 3, 1], [2, 3, 3], [2, 2, 4], [2, -1, 3]],
                         ids=["rank-low", "rank-high", "dim0", "dim1", "minus-one-for-fixed"])
def test_shape_rank_and_fixed_dims(reg, shape):
    err = refused(reg, infer(inputs=metas(FIXED_INPUTS, a={"shape": shape})))
    assert err.code is Code.INVALID_INPUT_SHAPE
    assert err.details == {"input": "a", "expected": [-1, 2, 3], "got": shape}


@pytest.mark.parametrize("dims", [(5, 7), (1, 1), (0, 0)])
def test_variable_dims_take_any_size(reg, dims):
    checked = check(reg, infer("var", metas(VAR_INPUTS, dims=dims)))
    assert checked.shape_key == ((dims[0],), (2, dims[1]))


@pytest.mark.parametrize("changes", [{"tokens": {"shape": [2, -3]}}, {"mask": {"shape": [2, 3, 7]}}],
                         ids=["negative", "fixed-dim"])
def test_variable_model_still_checks_dims(reg, changes):
    err = refused(reg, infer("var", metas(VAR_INPUTS, **changes)))
    assert err.code is Code.INVALID_INPUT_SHAPE and err.details["input"] in changes


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_variable_dim_of_minus_one_refused(reg, compression):
    req = infer("var", metas(VAR_INPUTS, dims=(-1, 7), tokens={"compression": compression}))
    err = refused(reg, req)
    assert err.code is Code.INVALID_INPUT_SHAPE and err.details["input"] == "tokens"


def test_inputs_must_agree_on_rows(reg):
    inputs = metas(FIXED_INPUTS, b={"shape": [3, 4]})
    err = refused(reg, infer(inputs=inputs[::-1]))   # the disagreement names the later declared input
    assert err.code is Code.INVALID_INPUT_SHAPE and err.details == {"input": "b"}


@pytest.mark.parametrize("rows", [0, MAX_ROWS + 1])
def test_rows_between_one_and_max_batch_size(reg, rows):
    err = refused(reg, infer(inputs=metas(FIXED_INPUTS, rows=rows)))
    assert err.code is Code.INVALID_INPUT_SHAPE
    assert err.details == {"max_batch_size": MAX_ROWS, "got": rows}
    assert err.message == f"inference request batch-size must be <= {MAX_ROWS} for 'fixed'"


def test_max_batch_size_rows_accepted(reg):
    assert check(reg, infer(inputs=metas(FIXED_INPUTS, rows=MAX_ROWS))).rows == MAX_ROWS


def test_unknown_compression(reg):
    err = refused(reg, infer(inputs=metas(FIXED_INPUTS, b={"compression": "zstd"})))
    assert err.code is Code.INVALID_ARGUMENT and "zstd" in err.message


@pytest.mark.parametrize("delta", [-1, 1, 4])
def test_frame_size_must_match_shape_and_dtype(reg, delta):
    req = infer()
    frames = frames_for(req)
    frames[1] += delta
    err = refused(reg, req, frames)
    assert err.code is Code.INVALID_ARGUMENT
    assert err.details == {"input": "b", "expected": 2 * 4 * 8, "got": 2 * 4 * 8 + delta}


def test_compressed_frame_size_is_not_checked(reg):
    req = infer(inputs=metas(FIXED_INPUTS, a={"compression": "lz4"}))
    assert check(reg, req, [17, 2 * 4 * 8]).rows == 2


# ---- outputs -----------------------------------------------------------------------------------

def test_outputs_default_to_all_declared(reg):
    assert check(reg, infer()).outputs == ["y", "z"]


@pytest.mark.parametrize("wanted", [["z"], ["z", "y"]])
def test_outputs_subset_in_requested_order(reg, wanted):
    assert check(reg, infer(outputs=wanted)).outputs == wanted


@pytest.mark.parametrize("wanted", [["w"], ["y", "w"], ["y", "y"]], ids=["unknown", "one-unknown", "duplicate"])
def test_outputs_unknown_or_duplicated(reg, wanted):
    err = refused(reg, infer(outputs=wanted))
    said = "unexpected inference output 'w' for model 'fixed'" if "w" in wanted else str(wanted)
    assert err.code is Code.INVALID_ARGUMENT and said in err.message


# ---- what an admitted request carries -----------------------------------------------------------

def test_checked_in_declared_order(reg):
    checked = check(reg, infer(inputs=metas(FIXED_INPUTS, rows=3)))
    assert checked.model is reg.models["fixed"]
    assert (checked.version, checked.order, checked.rows, checked.shape_key) == ("1", [0, 1], 3, ())


def test_checked_order_maps_declared_to_request_positions(reg):
    checked = check(reg, infer(inputs=metas(FIXED_INPUTS)[::-1]))
    assert checked.order == [1, 0] and checked.rows == 2 and checked.shape_key == ()


def test_variable_shape_key_in_declared_order(reg):
    checked = check(reg, infer("var", metas(VAR_INPUTS, rows=4, dims=(6, 9))[::-1], outputs=["logits"]))
    assert checked.order == [1, 0] and checked.rows == 4
    assert checked.shape_key == ((6,), (2, 9))
    assert checked.outputs == ["logits"]


# ---- versions over their life (broker/state/versions.py) ---------------------------------------------

def test_a_draining_version_is_refused_by_name_and_a_loading_one_is_not_ready_yet(reg):
    from tgw.broker.config.schema import VersionDecl
    records = reg.models["fixed"].records
    records["2"].seen = True
    reg.retire("fixed", [records["2"]])
    err = refused(reg, infer(version="2"))
    assert err.code is Code.VERSION_NOT_FOUND and "being unloaded" in err.message
    assert err.details["available"] == ["1"]
    reg.add_version("fixed", VersionDecl(version="3", path="f3.pt"))   # loading at run time, not flipped to
    assert refused(reg, infer(version="3")).code is Code.MODEL_NOT_READY


def test_unnamed_requests_follow_the_weights_and_a_routing_key_sticks(reg):
    entry = reg.models["fixed"]
    entry.records["2"].seen = True
    reg.weigh("fixed", {"1": 1, "2": 1})
    picks = [check(reg, infer()).version for _ in range(100)]
    assert picks.count("1") == picks.count("2") == 50
    keyed = {check(reg, infer(routing_key="user-7")).version for _ in range(20)}
    assert len(keyed) == 1
    assert entry.default == "2"   # equal weights: the later version
    reg.weigh("fixed", {})    # unnamed requests always have somewhere to go: the newest ready version
    assert {check(reg, infer()).version for _ in range(10)} == {"2"} and entry.records["2"].weight == 100
    reg.retire("fixed", list(entry.records.values()))
    err = refused(reg, infer())
    assert err.code is Code.MODEL_NOT_READY and err.details["reason"] == "no_version"


# ---- Triton's words, and a model without a batch dim ----------------------------------------------

def test_the_checks_clients_match_read_as_tritons(reg):
    """core's infer_request.cc words each check; clients match them by text."""
    a, b = metas(FIXED_INPUTS)
    assert refused(reg, infer(inputs=[a])).message == (
        "expected 2 inputs but got 1 inputs for model 'fixed'. Got input(s) ['a'], but missing required input(s) "
        "['b']. Please provide all required input(s).")
    assert refused(reg, infer(inputs=[a, TensorMeta(name="c", dtype="int64", shape=[2, 4])])).message == \
        "unexpected inference input 'c' for model 'fixed'"
    assert refused(reg, infer(inputs=metas(FIXED_INPUTS, b={"dtype": "int32"}))).message == \
        "inference input 'b' data-type is 'INT32', but model 'fixed' expects 'INT64'"
    odd = infer(inputs=metas(FIXED_INPUTS, b={"dtype": "complex64"}))   # a native client's: shown as sent
    assert "data-type is 'complex64'" in refused(reg, odd, [48, 0]).message
    err = refused(reg, infer(inputs=metas(FIXED_INPUTS, a={"shape": [2, 3, 2]})))
    assert err.message.startswith("unexpected shape for input 'a' for model 'fixed'. Expected [-1,2,3], got [2,3,2]. "
                                  "NOTE: Setting a non-zero max_batch_size") and err.code is Code.INVALID_INPUT_SHAPE
    req = infer()
    sizes = frames_for(req)
    assert refused(reg, req, [sizes[0] - 4, sizes[1]]).message == \
        f"input byte size mismatch for input 'a' for model 'fixed'. Expected {sizes[0]}, got {sizes[0] - 4}"
    assert refused(reg, infer(inputs=metas(FIXED_INPUTS, b={"shape": [3, 4]}))).message == \
        "input 'b' batch size does not match other inputs for 'fixed'"


@pytest.fixture
def flat(tmp_path) -> Registry:
    """"flat": max_batch_size 0, inputs [3, -1] and [2]."""
    unloaded_model(tmp_path / "m.pt")
    cfg = parse_config({"models": [
        {"name": "flat", "versions": [{"version": "1", "path": "m.pt"}], "max_batch_size": 0,
         "inputs": [{"name": "x", "dtype": "float32", "shape": [3, -1]}, {"name": "k", "dtype": "int64", "shape": [2]}],
         "outputs": [{"name": "y", "dtype": "float32", "shape": [3]}]}]}, base_dir=str(tmp_path))
    r = Registry(cfg.models)
    r.models["flat"].records["1"].seen = True
    return r


def test_no_batch_dim_takes_the_declared_shape_as_one_row(flat):
    req = Infer(v=1, id=1, model="flat", inputs=[TensorMeta(name="x", dtype="float32", shape=[3, 5]),
                                                  TensorMeta(name="k", dtype="int64", shape=[2])])
    checked = check(flat, req)
    assert checked.rows == 1 and checked.shape_key == ((3, 5), (2,)) and req.inputs[0].shape == [3, 5]
    req.inputs[0].shape = [1, 3, 5]   # a batch dim is a wrong shape here, worded without Triton's note
    assert refused(flat, req).message == \
        "unexpected shape for input 'x' for model 'flat'. Expected [3,-1], got [1,3,5]. "
