"""The registry of quantization schemes: one handler per scheme, each quantizing a Linear, rebuilding its
module from the config.json record and the stored tensors, and a quantize pass reaching every one."""

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.compress.quantize import quantize_pass, scheme_options, scheme_pass
from prunus.models.quant_registry import HANDLERS, handler, handler_of, is_quantized, quantized_layout
from prunus.models.schemes import SCHEMES

OPTIONS = {"int8-weight-only": {"granularity": "per_group", "group_size": 16},
           "w8a8-static": {"input_scale": 0.05},
           "int4-weight-only": {"group_size": 32, "symmetric": False}}


def test_every_scheme_has_one_handler_and_one_pass():
    assert tuple(HANDLERS) == SCHEMES
    for scheme, h in HANDLERS.items():
        assert h.scheme == scheme and callable(scheme_pass(scheme)) and "exclude" in scheme_options(scheme)
    with pytest.raises(PrunusError, match=r"^quantize: unknown scheme 'int3'; choose one of: int8-weight-only"):
        handler("int3")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_handler_rebuilds_its_module_from_the_record_and_the_stored_tensors(scheme):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, bias=True)
    h = handler(scheme)
    q = h.quantize(linear, **OPTIONS.get(scheme, {}))
    assert is_quantized(q) and handler_of(q) is h and not is_quantized(linear) and h.spec(q) == q.spec()
    assert q.spec()["scheme"] == scheme
    model = torch.nn.Sequential(torch.nn.Linear(64, 24, bias=True))
    quantized_layout(model, {"0": q.spec()})
    model.load_state_dict(q.state_dict(prefix="0."), strict=True)
    x = torch.randn(3, 64)
    assert handler_of(model[0]) is h and torch.equal(model[0](x), q(x))
    assert (q(x) - linear(x)).abs().max() < 0.2 * linear(x).abs().max()


def test_a_record_naming_no_scheme_is_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(64, 24))
    with pytest.raises(PrunusError, match=r"^config.json: module 0: unknown scheme None; choose one of"):
        quantized_layout(model, {"0": {"granularity": "per_channel"}})


def test_an_option_of_another_scheme_names_the_scheme_it_is_for(tiny_model):
    with pytest.raises(PrunusError, match=r"calibration: arguments that are for scheme int8-weight-only, .*"
                                          r"not int4-weight-only; drop them"):
        quantize_pass(tiny_model, None, scheme="int4-weight-only", calibration="minmax")
    with pytest.raises(PrunusError, match="scheme int8-weight-only takes no bits; its arguments: granularity"):
        quantize_pass(tiny_model, None, scheme="int8-weight-only", bits=4)
