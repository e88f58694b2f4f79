"""benchmarks/pick_held.py: the tuner's lines turned into the CUDA held kernels' settings."""

from __future__ import annotations

from benchmarks.pick_held import pick

LINES = """\
Q4_K experts tokens 8 default                    119.4 us    1.15 TB/s  drift 0.0e+00
Q4_K experts tokens 8 cuda w2                    115.4 us    1.19 TB/s  drift 5.6e-03
Q4_K experts tokens 8 cuda w4 STAGES=3 MIN_BLOCKS=3 101.0 us  1.3 TB/s  drift 2.8e-03
Q4_K experts tokens 32 default                   315.6 us    0.94 TB/s  drift 0.0e+00
Q4_K experts tokens 32 cuda w2                   209.5 us    1.42 TB/s  drift 6.3e-03
Q4_K experts tokens 32 cuda w4 STAGES=3 MIN_BLOCKS=3 210.0 us  1.4 TB/s  drift 6.3e-03
Q8_0 experts tokens 8 default                    130.3 us    1.99 TB/s  drift 0.0e+00
Q8_0 experts tokens 8 cuda w4 d2 STAGES=3 MIN_BLOCKS=3 126.9 us  2.04 TB/s  drift 4.4e-03
Q8_0 experts tokens 8 cuda w8 failed: out of resources
Q4_K qkv tokens 8 default                         10.0 us    1.0 TB/s  drift 0.0e+00
Q4_K qkv tokens 8 cuda                             8.0 us    1.2 TB/s  drift 1.0e-03
Q8_0 qkv tokens 8 default                         10.0 us    1.0 TB/s  drift 0.0e+00
Q8_0 qkv tokens 8 cuda                            12.0 us    0.8 TB/s  drift 1.0e-03
Q8_0 lm_head tokens 8 default                      2.0 us    5.0 TB/s  drift 0.0e+00
Q8_0 lm_head tokens 8 cuda                         1.0 us    9.9 TB/s  drift 1.0e-03
Q4_K lm_head tokens 8 default                      1.0 us    9.9 TB/s  drift 0.0e+00
Q4_K lm_head tokens 8 cuda                         2.0 us    5.0 TB/s  drift 1.0e-03
""".splitlines()


def test_pick_takes_the_least_summed_time_and_the_defines_that_apply() -> None:
    picked = pick(LINES)
    assert picked["experts"] == ["Q4_K", "Q8_0"]
    assert picked["warps"] == {"Q4_K": 4, "Q8_0": 4}
    assert picked["down_warps"] == {"Q4_K": 4, "Q8_0": 2}
    assert picked["defines"] == {"STAGES": "3", "MIN_BLOCKS": "3"}
    assert picked["linear"] == ["Q4_K"]  # an LM head's line is not a projection's
    assert picked["wide"] == ["Q8_0"]  # nor a projection's an LM head's


def test_a_define_goes_in_only_where_every_kind_picked_it() -> None:
    lines = [line.replace(" MIN_BLOCKS=3", "") if line.startswith("Q8_0") else line for line in LINES]
    assert pick(lines)["defines"] == {"STAGES": "3"}
    # a kind left with the Triton kernels has no say
    lines = [line for line in LINES if not line.startswith("Q8_0 experts tokens 8 cuda")]
    picked = pick(lines)
    assert picked["experts"] == ["Q4_K"]
    assert picked["defines"] == {"STAGES": "3", "MIN_BLOCKS": "3"}


def test_a_define_of_one_kind_goes_in_where_that_kind_picked_it() -> None:
    lines = [
        line.replace("STAGES=3 MIN_BLOCKS=3", "Q8_HALF=0") if line.startswith("Q8_0 experts") else line
        for line in LINES
    ]
    assert pick(lines)["defines"] == {"Q8_HALF": "0"}  # Q4_K's kernels are the same with it or without


def test_the_split_waves_with_the_least_time_over_the_kinds_on_cuda() -> None:
    split = [
        "Q4_K qkv tokens 8 cuda s2                          6.0 us    1.2 TB/s  drift 1.0e-03",
        "Q4_K qkv tokens 8 cuda s4                          7.0 us    1.2 TB/s  drift 1.0e-03",
        "Q8_0 qkv tokens 8 cuda s2                         11.0 us    1.2 TB/s  drift 1.0e-03",
    ]
    picked = pick(LINES + split)
    assert picked["linear"] == ["Q4_K"] and picked["split_waves"] == 2.0
    assert pick(LINES)["split_waves"] == 0.0


def test_a_block_a_pair_goes_in_where_every_kind_on_cuda_picked_it() -> None:
    per_pair = [
        "Q4_K experts tokens 8 cuda w4 p8 STAGES=3 MIN_BLOCKS=3 90.0 us  1.4 TB/s  drift 2.8e-03",
        "Q4_K experts tokens 32 cuda w4 p8 STAGES=3 MIN_BLOCKS=3 209.0 us  1.4 TB/s  drift 2.8e-03",
    ]
    picked = pick(LINES + per_pair)
    assert picked["warps"]["Q4_K"] == 4 and picked["defines"] == {"STAGES": "3", "MIN_BLOCKS": "3"}
    assert picked["per_pair"] == 0  # Q8_0's experts, on the CUDA kernels too, kept the grouping launch
    q8_0 = ["Q8_0 experts tokens 8 cuda w4 d2 p8 STAGES=3 MIN_BLOCKS=3 100.0 us  2.04 TB/s  drift 4.4e-03"]
    picked = pick(LINES + per_pair + q8_0)
    assert picked["per_pair"] == 8 and picked["down_warps"] == {"Q4_K": 4, "Q8_0": 2}


def test_the_dense_projections_defines_with_the_least_time_over_the_kinds_on_cuda() -> None:
    deep = [
        "Q4_K qkv tokens 8 cuda DENSE_STAGES=5               5.0 us    1.2 TB/s  drift 1.0e-03",
        "Q4_K qkv tokens 8 cuda s2 DENSE_STAGES=5            7.5 us    1.2 TB/s  drift 1.0e-03",
        "Q4_K qkv tokens 8 cuda s2                           7.0 us    1.2 TB/s  drift 1.0e-03",
    ]
    picked = pick(LINES + deep)
    assert picked["split_waves"] == 0.0
    assert picked["defines"] == {"STAGES": "3", "MIN_BLOCKS": "3", "DENSE_STAGES": "5"}
    split_deep = [line.replace("7.5 us", "4.0 us") for line in deep]
    picked = pick(LINES + split_deep)
    assert picked["split_waves"] == 2.0 and picked["defines"]["DENSE_STAGES"] == "5"


def test_a_block_an_expert_goes_in_for_the_kinds_that_picked_it() -> None:
    per_expert = [
        "Q4_K experts tokens 8 cuda w4 e8 STAGES=3 MIN_BLOCKS=3 90.0 us  1.4 TB/s  drift 2.8e-03",
        "Q4_K experts tokens 32 cuda w4 e8 STAGES=3 MIN_BLOCKS=3 209.0 us  1.4 TB/s  drift 2.8e-03",
        "Q8_0 experts tokens 8 cuda w4 d2 e8 STAGES=3 MIN_BLOCKS=3 100.0 us  2.04 TB/s  drift 4.4e-03",
    ]
    picked = pick(LINES + per_expert)
    assert picked["per_expert"] == {"Q4_K": 8, "Q8_0": 8} and picked["per_pair"] == 0
    assert picked["warps"] == {"Q4_K": 4, "Q8_0": 4}
    assert pick(LINES + per_expert[:2])["per_expert"] == {"Q4_K": 8, "Q8_0": 0}  # Q8_0 kept the tiles


def test_a_choice_whose_result_strays_from_the_default_is_never_picked() -> None:
    wrong = [
        "Q4_K experts tokens 8 cuda w4 e8 STAGES=3 MIN_BLOCKS=3 50.0 us  2.4 TB/s  drift 3.1e-01",
        "Q4_K experts tokens 32 cuda w4 e8 STAGES=3 MIN_BLOCKS=3 100.0 us  2.4 TB/s  drift 6.3e-03",
        "Q4_K qkv tokens 8 cuda s2                          1.0 us    9.2 TB/s  drift nan",
    ]
    picked = pick(LINES + wrong)
    assert (
        picked["per_expert"]["Q4_K"] == 0 and "cuda w4 e8 STAGES=3 MIN_BLOCKS=3" not in picked["sums"]["Q4_K"]
    )
    assert picked["split_waves"] == 0.0
