"""The fake NVML (tests/hardware/fake_nvml.py) against the real binding: it may not answer a call that
pynvml does not have, take other arguments, or raise what pynvml would not. Line numbers: pynvml.py of
nvidia-ml-py 13.615.71."""

import inspect

import pynvml
import pytest

from tests.hardware.fake_nvml import (
    GARBAGE,
    NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS,
    FakeGpu,
    FakeNvml,
    NVMLError_InvalidArgument,
    NVMLError_NotSupported,
)

FAKE_ONLY = {"bump", "bump_field", "raise_xid"}  # the tests' own handles on the fake GPUs


def test_every_fake_function_is_a_real_one_with_the_same_arguments():
    """Each ``nvml*`` method has pynvml's function of that name, with as many parameters."""
    fake = FakeNvml(1)
    names = [n for n in dir(FakeNvml) if n.startswith("nvml") and callable(getattr(FakeNvml, n))]
    assert len(names) >= 20
    for name in names:
        real = inspect.signature(getattr(pynvml, name))
        ours = inspect.signature(getattr(fake, name))
        assert len(ours.parameters) == len(real.parameters), (name, ours, real)
    assert {n for n in dir(FakeNvml) if not n.startswith(("_", "nvml"))} == FAKE_ONLY


def test_constants_errors_and_structs_are_the_real_ones():
    fake = FakeNvml(1)
    assert fake.NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS == pynvml.NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS == 221
    assert fake.NVMLError is pynvml.NVMLError and fake.c_nvmlFieldValue_t is pynvml.c_nvmlFieldValue_t
    # pynvml.py:1062 NVMLError.__new__: NVMLError(code) is the subclass of that code.
    assert type(fake.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) is pynvml.NVMLError_NotSupported
    with pytest.raises(AttributeError):
        FakeNvml(1, missing=("nvmlDeviceGetGpuFabricInfoV",)).nvmlDeviceGetGpuFabricInfoV  # noqa: B018


def test_per_link_calls_refuse_as_nvml_documents():
    """dcgm_nvml.h nvmlDeviceGetNvLinkState: INVALID_ARGUMENT "if device or link is invalid",
    NOT_SUPPORTED "if the device doesn't support this feature"."""
    nvml = FakeNvml([FakeGpu(0), FakeGpu(1, links=0)])
    hopper, pcie = nvml.gpus
    assert nvml.nvmlDeviceGetNvLinkState(hopper, 17) == pynvml.NVML_FEATURE_ENABLED
    with pytest.raises(NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkState(hopper, 18)
    with pytest.raises(NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(pcie, 0)
    with pytest.raises(NVMLError_NotSupported):  # NVLink 5: the old counters are gone
        nvml.nvmlDeviceGetNvLinkErrorCounter(FakeGpu(2, nvlink=5), 0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY)


def test_field_values_carry_their_own_return_codes_and_garbage_where_they_failed():
    """pynvml.py:5004 nvmlDeviceGetFieldValues raises only when the whole call fails; dcgm_nvml.h: "you must
    check the nvmlReturn field of each value"."""
    nvml = FakeNvml([FakeGpu(0), FakeGpu(1, nvlink=5)])
    hopper, blackwell = nvml.gpus
    fields = [(NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS, 0), (NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS, 18)]
    values = nvml.nvmlDeviceGetFieldValues(hopper, fields)
    assert isinstance(values[0], pynvml.c_nvmlFieldValue_t)
    assert [v.nvmlReturn for v in values] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 2
    assert values[0].value.ullVal == GARBAGE
    nvml.bump_field(1, NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS, link=0, by=5)
    values = nvml.nvmlDeviceGetFieldValues(
        blackwell, [*fields, (NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS, 0xFFFFFFFF)]
    )
    assert [v.nvmlReturn for v in values] == [0, pynvml.NVML_ERROR_INVALID_ARGUMENT, 0]
    assert (values[0].valueType, values[0].value.ullVal, values[2].value.ullVal) == (
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
        5,
        5,
    )
