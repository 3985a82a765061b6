"""RowTags: each sample's tags built only when asked for, with user tags kept apart (what
put_samples and extend send without building a tag map per sample)."""

import pytest

from rlplane.tags import FINISHED_TAG, SUM_TAG, WIRE_TAG, RowTags, merge_tags, unfinished


def rows() -> RowTags:
    return RowTags(None, {"input_ids": [[3], [5]]}, {"input_ids": [7, 9]})


def test_with_user_adds_user_tags_without_building_and_equals_merging_each():
    tags = rows()
    user = [{"group": "a", FINISHED_TAG: False}, None]
    mine = tags.with_user(user)
    assert list(mine) == [merge_tags(u or {}, t) for u, t in zip(user, rows())]
    assert mine.user_tags() == user and mine.has_user_tags()
    assert unfinished(mine[0]) and not unfinished(mine[1])
    with pytest.raises(ValueError):
        tags.with_user([None])


def test_a_built_and_edited_tag_map_keeps_its_geometry_through_take_and_with_user():
    tags = rows()
    tags[0]["x"] = 1  # built, then edited
    taken = tags.take([0, 1])
    assert taken[0] == {"x": 1, WIRE_TAG: {"input_ids": [3]}, SUM_TAG: {"input_ids": 7}}
    mine = tags.with_user([{"y": 2}, None])
    assert mine[0][WIRE_TAG] == {"input_ids": [3]} and mine[0]["x"] == 1 and mine[0]["y"] == 2
    assert mine.user_tags() == [{"x": 1, "y": 2}, None]


def test_merged_keeps_old_user_tags_and_lets_the_new_ones_win():
    old = rows().with_user([{"a": 1, FINISHED_TAG: False}, {"a": 2}])
    new = RowTags(None, {"input_ids": [[4], [6]]}, {"input_ids": [1, 2]}).with_user([{FINISHED_TAG: True}] * 2)
    got = old.merged(new)
    assert isinstance(got, RowTags)
    assert list(got) == [merge_tags(a, b) for a, b in zip(old, new)]
    assert got[0][FINISHED_TAG] is True and got[0]["a"] == 1 and got[1][WIRE_TAG] == {"input_ids": [6]}


def test_user_tags_never_carry_rlplanes_reserved_keys():
    tags = rows()
    tags[0]["x"] = 1
    for t in (tags, tags.take([1, 0]), tags.with_user([{"y": 2}, None]), rows().with_user([{"y": 2}, None])):
        assert all(not k.startswith("_rlplane") for u in t.user_tags() if u for k in u)
    assert tags.take([1, 0]).user_tags() == [None, {"x": 1}]


def test_born_of_reads_each_samples_incarnation_and_never_rounds_an_odd_value_into_one():
    import numpy as np

    from rlplane.tags import BORN_TAG, born_of, stale

    assert born_of([{BORN_TAG: 5}, {}, {BORN_TAG: 7}]).tolist() == [5, 0, 7]
    assert born_of([{}, {"group": 1}]) is None  # nothing to check
    # a hand-edited or foreign value is "not known" (0), never a number close to it
    for odd in (1.9, True, "7", 1 << 70, -3):
        assert born_of([{BORN_TAG: 5}, {BORN_TAG: odd}]).tolist() == [5, 0], odd
    assert stale(np.array([5, 0, 7, 3]), np.array([5, 9, 8, 0])).tolist() == [2]  # both known and different


def test_tags_put_together_keep_each_samples_user_tags_geometry_and_digest():
    import numpy as np

    from rlplane.geometry import Geometry

    def first() -> RowTags:
        return RowTags(None, {"x": Geometry.token(np.array([3, 5]), [])}, {"x": np.array([7, 9], np.uint64)})

    second = RowTags([{"group": "g"}], {"x": Geometry.token(np.array([4]), [])}, {"x": np.array([11], np.uint64)})
    both = RowTags.concat([first(), second])
    assert both.user == [None, None, {"group": "g"}] and both.geoms["x"].dense  # (nothing built)
    assert list(both) == list(first()) + list(second)
    assert RowTags.concat([first(), first()]).user is None
    edited = RowTags(None, {"x": [[4]]}, {"x": [11]})
    edited[0]["note"] = 1  # a built map that was edited comes along as it is
    assert list(RowTags.concat([first(), edited])) == list(first()) + [edited[0]]


BAD_TAGS = [
    ({"k": {1: 2}}, "map key 1 that is not a str"),
    ({"k": b"\xff\xfe"}, "holds a bytes"),
    ({"k": float("nan")}, "not finite"),
    ({"k": ["ok", "\ud800"]}, "lone surrogate"),
    ({"k": 1 << 64}, "more than 64 bits"),
    ({"k": {"a": object()}}, "holds a object"),
    ({"k": [[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]}, "nested more than 16 deep"),
    ({"_rlplane_wire": {}}, "reserved for rlplane"),
    ({2: "x"}, "tag keys must be strings"),
    ({"k": "x" * ((1 << 20) + 1)}, "a str of 1048577 bytes"),  # (the engine cannot decode it: the put timed out)
    ({"k": [0] * ((4 << 20) + 1)}, "4194305 items"),
    ({"k": __import__("types").MappingProxyType({"a": 1})}, "holds a mappingproxy"),  # (msgpack packs dicts only)
]


@pytest.mark.parametrize("tag,why", BAD_TAGS, ids=[w for _, w in BAD_TAGS])
def test_a_user_tag_no_store_or_transport_can_hand_back_is_refused_naming_sample_and_key(tag, why):
    from rlplane.errors import ShapeError
    from rlplane.tags import check_user_tags

    with pytest.raises(ShapeError, match=why) as err:
        check_user_tags(tag, sample="s7")
    assert err.value.sample == "s7"


def test_json_like_user_tags_pass_as_they_are():
    from rlplane.tags import check_user_tags

    tag = {"group_id": "g3", "reward": -0.5, "policy_version": 1 << 62, "finished": False, "none": None,
           "steps": [1, 2.5, "x", None, {"nested": [True]}], "meta": {"a": {"b": [0]}}}
    assert check_user_tags(tag, sample="s") == tag


def test_written_tags_carry_only_the_wire_geometry_and_digests_of_the_written_columns():
    from rlplane.errors import ShapeError
    from rlplane.tags import check_written_tags

    check_written_tags([{WIRE_TAG: {"a": [3]}, SUM_TAG: {"a": 7}, "group": 1}], ["s"], ["a"])
    for bad in ({WIRE_TAG: 5}, {WIRE_TAG: {"b": [3]}}, {SUM_TAG: {"b": 1}}, {"_rlplane_born": 3}, {"k": {1: 2}}):
        with pytest.raises(ShapeError):
            check_written_tags([bad], ["s"], ["a"])


def test_the_engine_takes_back_what_an_earlier_release_stored_but_not_tags_nested_deep():
    """A snapshot or a journal of an earlier release may hold bytes or NaN tags (its Client
    took any msgpack-able value): a restore must not fail on them; nesting it cannot answer."""
    from rlplane.errors import ShapeError
    from rlplane.tags import check_user_tags

    old = {"reward": float("nan"), "raw": b"\xff", "deep": [[[1]]]}
    assert check_user_tags(old, sample="s", strict=False) == old
    deep: list = []
    for _ in range(20):
        deep = [deep]
    with pytest.raises(ShapeError, match="nested"):
        check_user_tags({"k": deep}, sample="s", strict=False)
