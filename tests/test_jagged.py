"""jagged.py: lengths <-> offsets, padded <-> jagged, torchrec kinds <-> (values, offsets)."""
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from blockattn_layers import (
    jagged_to_padded, lengths_to_key_padding_mask, lengths_to_offsets, offsets_to_lengths, padded_to_jagged,
    to_values_offsets,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only contend

META = torch.device("meta")


def _loop_jagged(x, lengths):
    """Oracle: the valid rows of each padded sequence, concatenated by a Python loop."""
    return torch.cat([x[b, :n] for b, n in enumerate(lengths.tolist())])


# ----------------------------------------------------------------------------- lengths, offsets
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_lengths_offsets_round_trip_keeps_dtype(dtype):
    lengths = torch.tensor([3, 0, 1, 64, 65], dtype=dtype)
    offsets = lengths_to_offsets(lengths)
    assert offsets.dtype == dtype
    assert offsets.tolist() == [0, 3, 3, 4, 68, 133]
    assert offsets_to_lengths(offsets).dtype == dtype
    assert torch.equal(offsets_to_lengths(offsets), lengths)


def test_lengths_to_offsets_empty_and_explicit_dtype():
    assert lengths_to_offsets(torch.zeros(0, dtype=torch.int64)).tolist() == [0]
    assert lengths_to_offsets(torch.tensor([2, 2], dtype=torch.int32), torch.int64).dtype == torch.int64


def test_lengths_offsets_bad_input():
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        lengths_to_offsets(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="int32 or int64"):
        lengths_to_offsets(torch.ones(2), dtype=torch.float32)
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        offsets_to_lengths(torch.zeros(0, dtype=torch.int64))


def test_key_padding_mask_from_lengths():
    mask = lengths_to_key_padding_mask(torch.tensor([2, 0, 3]), 3)
    assert mask.tolist() == [[False, False, True], [True, True, True], [False, False, False]]


# ----------------------------------------------------------------------------- padded <-> jagged
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_padded_to_jagged_matches_loop(dtype):
    x = torch.randn(4, 6, 3, 2)
    lengths = torch.tensor([6, 0, 1, 4], dtype=dtype)
    values, offsets = padded_to_jagged(x, lengths)
    assert torch.equal(values, _loop_jagged(x, lengths))
    assert offsets.dtype == dtype and offsets.tolist() == [0, 6, 6, 7, 11]
    values_given_t, _ = padded_to_jagged(x, lengths, total_length=11)
    assert torch.equal(values_given_t, values)


def test_padded_to_jagged_with_key_padding_mask():
    x = torch.randn(3, 5, 4)
    lengths = torch.tensor([5, 2, 0])
    mask = lengths_to_key_padding_mask(lengths, 5)
    values, offsets = padded_to_jagged(x, key_padding_mask=mask)
    assert torch.equal(values, _loop_jagged(x, lengths))
    assert offsets.tolist() == [0, 5, 7, 7]
    assert torch.equal(padded_to_jagged(x, key_padding_mask=mask, total_length=7)[0], values)


def test_any_mask_pattern_round_trips():
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[True, False, True, False], [False, False, True, True]])
    values, offsets = padded_to_jagged(x, key_padding_mask=mask)
    assert torch.equal(values, torch.stack([x[0, 1], x[0, 3], x[1, 0], x[1, 1]]))
    assert offsets.tolist() == [0, 2, 4]
    back = jagged_to_padded(values, offsets, key_padding_mask=mask, padding_value=-1.0)
    assert torch.equal(back[~mask], values) and bool((back[mask] == -1).all())


def test_jagged_to_padded_inverts_and_truncates():
    values = torch.arange(7.0)[:, None].repeat(1, 2)
    offsets = torch.tensor([0, 3, 3, 7])
    padded = jagged_to_padded(values, offsets, padding_value=-5.0)
    assert padded.shape == (3, 4, 2)
    assert padded[:, :, 0].tolist() == [[0, 1, 2, -5], [-5, -5, -5, -5], [3, 4, 5, 6]]
    assert torch.equal(padded_to_jagged(padded, offsets_to_lengths(offsets))[0], values)
    cut = jagged_to_padded(values, offsets, max_length=2)
    assert cut[:, :, 0].tolist() == [[0, 1], [0, 0], [3, 4]]


def test_jagged_to_padded_gradient_reaches_valid_tokens_only():
    values = torch.randn(5, 3, requires_grad=True)
    padded = jagged_to_padded(values, torch.tensor([0, 4, 5]), max_length=2)
    (padded * 2).sum().backward()
    assert values.grad[:, 0].tolist() == [2, 2, 0, 0, 2]


def test_padded_bad_input():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="exactly one"):
        padded_to_jagged(x)
    with pytest.raises(ValueError, match="exactly one"):
        padded_to_jagged(x, torch.tensor([1, 1]), key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, N=3\]"):
        padded_to_jagged(x, torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        padded_to_jagged(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        jagged_to_padded(torch.randn(2, 4), torch.tensor([0, 2]), key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    # A total_length that is not the tokens' count would drop or invent tokens: checked on the host.
    for total in (2, 4):
        with pytest.raises(ValueError, match=r"total_length \(\d\) must equal the number of valid tokens \(3\)"):
            padded_to_jagged(x, torch.tensor([2, 1]), total_length=total)
        with pytest.raises(ValueError, match="must equal the number of valid tokens"):
            padded_to_jagged(x, key_padding_mask=torch.tensor([[False, False, True], [False, True, True]]),
                             total_length=total)
    with pytest.raises(ValueError, match="total_length must be a non-negative int or None, got -1"):
        padded_to_jagged(x, torch.tensor([2, 1]), total_length=-1)
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal T = 4 \(values\.shape\[0\]\), got 3"):
        jagged_to_padded(torch.randn(4, 2), torch.tensor([0, 3, 3]))
    with pytest.raises(ValueError, match="max_length must be a non-negative int or None, got -1"):
        jagged_to_padded(torch.randn(4, 2), torch.tensor([0, 3, 4]), max_length=-1)


def test_sync_free_paths_run_on_meta_tensors():
    # Meta tensors hold no data: any .item()/.tolist()/host read would raise.
    lengths = torch.tensor([2, 0, 3], device=META)
    offsets = lengths_to_offsets(lengths)
    values, offsets = padded_to_jagged(torch.randn(3, 4, 5, device=META), lengths, total_length=5)
    assert values.shape == (5, 5) and offsets.shape == (4,)
    assert jagged_to_padded(values, offsets, max_length=4).shape == (3, 4, 5)
    mask = lengths_to_key_padding_mask(lengths, 4)
    assert padded_to_jagged(torch.randn(3, 4, 5, device=META), key_padding_mask=mask, total_length=5)[0].shape == (5, 5)
    assert jagged_to_padded(values, offsets, key_padding_mask=mask).shape == (3, 4, 5)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=0, max_size=8), st.integers(0, 3))
def test_round_trip_fuzz(lengths, extra):
    n = max(lengths, default=0) + extra
    lengths = torch.tensor(lengths, dtype=torch.int64)
    x = torch.randn(len(lengths), n, 3)
    values, offsets = padded_to_jagged(x, lengths)
    assert torch.equal(values, _loop_jagged(x, lengths)) if len(lengths) else values.shape == (0, 3)
    back = jagged_to_padded(values, offsets, n)
    valid = ~lengths_to_key_padding_mask(lengths, n)
    assert torch.equal(back[valid], x[valid]) and bool((back[~valid] == 0).all())


# ----------------------------------------------------------------------------- tensors and errors
def test_tensor_kind_passes_through():
    values, offsets = torch.randn(5, 4), torch.tensor([0, 2, 5])
    v, o, layout = to_values_offsets(values, offsets)
    assert v is values and o is offsets and layout.wrap(v) is v


def test_adapter_errors():
    with pytest.raises(TypeError, match="offsets is required"):
        to_values_offsets(torch.randn(3, 2))
    with pytest.raises(TypeError, match="got list"):
        to_values_offsets([torch.randn(3, 2)])
    with pytest.raises(TypeError, match="got dict"):
        to_values_offsets({})


def test_package_imports_and_runs_without_torchrec():
    code = textwrap.dedent("""
        import sys
        sys.modules["torchrec"] = None  # any "import torchrec" now raises ImportError
        import torch
        import blockattn_layers
        layer = blockattn_layers.JaggedTransformerEncoderLayer(16, 2, 32, block_size=4)
        assert layer(torch.randn(7, 16), torch.tensor([0, 3, 7])).shape == (7, 16)
        assert not any(name.startswith("torchrec.") for name in sys.modules)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


# ----------------------------------------------------------------------------- torchrec kinds
def _jt_types():
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    return JaggedTensor, KeyedJaggedTensor


@pytest.mark.parametrize("given", ["lengths", "offsets"])
def test_jagged_tensor_round_trip(given):
    JaggedTensor, _ = _jt_types()
    lengths = torch.tensor([2, 0, 3], dtype=torch.int32)
    spec = {"lengths": lengths} if given == "lengths" else {"offsets": lengths_to_offsets(lengths)}
    weights = torch.rand(5)
    jt = JaggedTensor(values=torch.randn(5, 4), weights=weights, **spec)
    values, offsets, layout = to_values_offsets(jt)
    assert values is jt.values()
    assert offsets.tolist() == [0, 2, 2, 5] and offsets.dtype == torch.int32
    # The input is left as it was: no offsets computed and cached on it (that path needs fbgemm).
    assert (jt.offsets_or_none() is None) == (given == "lengths")
    out = layout.wrap(values * 3)
    assert type(out) is JaggedTensor
    assert torch.equal(out.values(), values * 3)
    assert out.lengths().tolist() == [2, 0, 3] and out.weights() is weights


def test_keyed_jagged_tensor_round_trip():
    _, KeyedJaggedTensor = _jt_types()
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(6.0), lengths=torch.tensor([1, 2, 0, 3], dtype=torch.int32),
    )
    values, offsets, layout = to_values_offsets(kjt)
    assert offsets.tolist() == [0, 1, 3, 3, 6] and kjt.offsets_or_none() is None
    out = layout.wrap(values + 10)
    assert type(out) is KeyedJaggedTensor
    assert out.keys() == ["a", "b"] and out.stride() == 2
    assert out.lengths().tolist() == [1, 2, 0, 3]
    assert out["b"].values().tolist() == [13.0, 14.0, 15.0]


def test_variable_batch_keyed_jagged_tensor_round_trip():
    _, KeyedJaggedTensor = _jt_types()
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(6.0), lengths=torch.tensor([1, 2, 3]), stride_per_key_per_rank=[[2], [1]],
    )
    values, offsets, layout = to_values_offsets(kjt)
    assert offsets.tolist() == [0, 1, 3, 6]
    out = layout.wrap(values * 2)
    assert out.variable_stride_per_key() and out.stride_per_key() == [2, 1]
    assert out["b"].values().tolist() == [6.0, 8.0, 10.0]


def test_dict_round_trip_concatenates_keys_in_order():
    JaggedTensor, _ = _jt_types()
    d = {
        "clicks": JaggedTensor(values=torch.randn(4, 3), lengths=torch.tensor([1, 3])),
        "views": JaggedTensor(values=torch.randn(5, 3), offsets=torch.tensor([0, 0, 2, 5])),
    }
    values, offsets, layout = to_values_offsets(d)
    assert torch.equal(values, torch.cat([d["clicks"].values(), d["views"].values()]))
    assert offsets.tolist() == [0, 1, 4, 4, 6, 9]
    out = layout.wrap(values * 2)
    assert list(out) == ["clicks", "views"]
    for key in d:
        assert type(out[key]) is JaggedTensor
        assert torch.equal(out[key].values(), d[key].values() * 2)
        assert torch.equal(out[key].lengths(), d[key].lengths())
    single, single_offsets, single_layout = to_values_offsets({"views": d["views"]})
    assert single_offsets.tolist() == [0, 0, 2, 5]
    assert torch.equal(single_layout.wrap(single)["views"].values(), d["views"].values())


def test_layout_flatten_aligns_side_inputs():
    JaggedTensor, _ = _jt_types()
    d = {
        "a": JaggedTensor(values=torch.randn(2, 3), lengths=torch.tensor([2])),
        "b": JaggedTensor(values=torch.randn(3, 3), lengths=torch.tensor([3])),
    }
    times = {
        "b": JaggedTensor(values=torch.tensor([5.0, 6.0, 7.0]), lengths=torch.tensor([3])),
        "a": JaggedTensor(values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([2])),
    }
    _, _, layout = to_values_offsets(d)
    assert layout.flatten(times).tolist() == [1.0, 2.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match=r"lacks keys \['b'\]"):
        layout.flatten({"a": times["a"]})
    with pytest.raises(ValueError, match="T = 5 rows"):
        layout.wrap(torch.randn(4, 3))
    # Side inputs of other lengths, or of another kind, are refused in the argument's name.
    shifted = {"a": JaggedTensor(values=torch.randn(3), lengths=torch.tensor([3])),
               "b": JaggedTensor(values=torch.randn(2), lengths=torch.tensor([2]))}
    with pytest.raises(ValueError, match=r"positions must have the input's lengths: offsets \[0, 3, 5\] against "
                                         r"the input's \[0, 2, 5\]"):
        layout.flatten(shifted)
    with pytest.raises(TypeError, match=r"positions must be a \[T\] tensor, or a dict of JaggedTensors or a "
                                        r"KeyedJaggedTensor with the input's keys, got list"):
        layout.flatten([1.0] * 5)
    with pytest.raises(ValueError, match=r"positions has keys \['c'\] that the input has not"):
        layout.flatten({**times, "c": times["a"]})
    _, _, packed = to_values_offsets(torch.randn(5, 3), torch.tensor([0, 2, 5]))
    with pytest.raises(TypeError, match=r"positions must be a \[T\] tensor when the input is a tensor"):
        packed.flatten(times)


def test_layout_flatten_matches_keyed_side_inputs_by_key():
    """For a KeyedJaggedTensor or dict input, positions keyed by feature (a dict, or a
    KeyedJaggedTensor in another key order) are taken key by key in the input's order, not in
    their own concatenation order."""
    JaggedTensor, KeyedJaggedTensor = _jt_types()
    lengths = torch.tensor([3, 2, 3, 2])  # both keys' lengths alike: a mix-up would pass a lengths check
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.randn(10, 4), lengths=lengths)
    pa, pb = torch.arange(5.0), torch.arange(5.0) + 100
    want = torch.cat([pa, pb]).tolist()
    by_dict = {"b": JaggedTensor(values=pb, lengths=lengths[2:]), "a": JaggedTensor(values=pa, lengths=lengths[:2])}
    reordered = KeyedJaggedTensor(keys=["b", "a"], values=torch.cat([pb, pa]),
                                  lengths=torch.cat([lengths[2:], lengths[:2]]))
    for inputs in (kjt, {"a": JaggedTensor(values=torch.randn(5, 4), lengths=lengths[:2]),
                         "b": JaggedTensor(values=torch.randn(5, 4), lengths=lengths[2:])}):
        _, _, layout = to_values_offsets(inputs)
        assert layout.flatten(by_dict).tolist() == want and layout.flatten(reordered).tolist() == want
    _, _, single = to_values_offsets(JaggedTensor(values=torch.randn(5, 4), lengths=lengths[:2]))
    with pytest.raises(TypeError, match=r"positions must be a \[T\] tensor or a JaggedTensor, as the input, got dict"):
        single.flatten(by_dict)


def test_torchrec_kinds_refuse_offsets_argument():
    JaggedTensor, _ = _jt_types()
    jt = JaggedTensor(values=torch.randn(2, 3), lengths=torch.tensor([2]))
    with pytest.raises(TypeError, match="offsets must be None"):
        to_values_offsets(jt, torch.tensor([0, 2]))


# ----------------------------------------------------------------------------- torchrec lazy awaitables
def _counting_awaitable(result):
    pytest.importorskip("torchrec")
    from torchrec.distributed.types import LazyAwaitable

    class Counting(LazyAwaitable):
        def __init__(self):
            super().__init__()
            self.waits = 0

        def _wait_impl(self):
            self.waits += 1
            return result

    return Counting()


def test_lazy_awaitable_is_waited_once_and_flattened_as_its_result():
    JaggedTensor, _ = _jt_types()
    d = {
        "clicks": JaggedTensor(values=torch.randn(4, 3), lengths=torch.tensor([1, 3])),
        "views": JaggedTensor(values=torch.randn(2, 3), lengths=torch.tensor([2, 0])),
    }
    awaitable = _counting_awaitable(d)
    values, offsets, layout = to_values_offsets(awaitable)
    assert torch.equal(values, torch.cat([d["clicks"].values(), d["views"].values()]))
    assert offsets.tolist() == [0, 1, 4, 6, 6] and layout.kind == "dict"
    out = layout.wrap(values + 1)
    assert type(out) is dict and list(out) == ["clicks", "views"]
    to_values_offsets(awaitable)
    assert awaitable.waits == 1  # cached on the awaitable, as torchrec's own lazy wait does
    jt = d["views"]
    assert to_values_offsets(_counting_awaitable(jt))[2].kind == "jagged_tensor"


def test_dict_of_lazy_awaitables_and_nested_awaitables_resolve():
    from blockattn_layers.jagged import resolve_awaitable

    JaggedTensor, _ = _jt_types()
    jt = JaggedTensor(values=torch.randn(3, 2), lengths=torch.tensor([3]))
    resolved = resolve_awaitable({"a": _counting_awaitable(jt)})
    assert resolved["a"] is jt
    assert resolve_awaitable(_counting_awaitable(_counting_awaitable(jt))) is jt
    plain = {"a": jt}
    assert resolve_awaitable(plain) is plain


def test_fx_proxy_gets_a_hint_to_trace_the_module_as_a_leaf():
    graph = torch.fx.Graph()
    proxy = torch.fx.Proxy(graph.placeholder("x"))
    with pytest.raises(TypeError, match="leaf"):
        to_values_offsets(proxy)
