import pytest

from backend.sampling_params import SamplingParamsError, parse_sampling_params


@pytest.mark.parametrize(
    "raw, name",
    [
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_out_of_range_values_name_the_parameter(raw, name):
    with pytest.raises(SamplingParamsError, match=name):
        parse_sampling_params(raw)


def test_unsupported_parameters_are_refused_not_ignored():
    with pytest.raises(SamplingParamsError, match="image"):
        parse_sampling_params({"image_data": "x.png"})
    with pytest.raises(SamplingParamsError, match="unknown sampling parameter"):
        parse_sampling_params({"temprature": 0.5})
    # "off" values of unimplemented features are harmless and accepted.
    assert parse_sampling_params({"n": 1, "return_logprob": False}).max_new_tokens == 128


def test_defaults_apply_under_request_values():
    p = parse_sampling_params({"top_p": 0.5}, defaults={"temperature": 0.7, "top_p": 0.8})
    assert p.temperature == 0.7 and p.top_p == 0.5
    assert parse_sampling_params({"stop": "x"}).stop == ["x"]
