"""The Lua loader (api/protocol/scripts.py): includes resolved by name, one clear error for an unknown include or a
cycle, layouts that name every argument, constants declared in the prologue; and every shipped script accepted by
a real Redis, with its queue-name helpers agreeing with ``Keys``. (Mixed tiers: the conftest marks each test.)"""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
import redis.asyncio as aredis

from mlxq.api import batches, registry
from mlxq.api.protocol import claim, emit, producer, upkeep
from mlxq.api.protocol.keys import Keys
from mlxq.api.protocol.scripts import Layout, Script, ScriptError, compose

SHIPPED: list[Script] = [claim.CLAIM, emit.EMIT, producer.ENQUEUE, producer.CANCEL, upkeep.REFRESH, upkeep.SWEEP,
                         batches.RECORD, batches.STATUS, batches.LEASE,
                         upkeep.LAPSE, upkeep.REJECT, registry._QUEUE_STATS]


def parts(**texts: str) -> Any:
    """A part reader over ``texts`` (what the loader reads from lua/ otherwise)."""
    def read(name: str) -> str:
        if name not in texts:
            raise ScriptError(f"no Lua part named {name!r}")
        return texts[name]
    return read


def test_an_include_is_replaced_by_the_part_of_its_name() -> None:
    script = compose("main", "--#include greet\nreturn greet()\n", Layout(),
                     read=parts(greet="local function greet() return 'hi' end\n"))
    body = script.source.split("return greet()")[0]
    assert "local function greet() return 'hi' end" in body
    assert "--#include" not in script.source


def test_a_part_included_twice_is_written_once() -> None:
    read = parts(a="--#include base\nlocal A = 1\n", b="--#include base\nlocal B = 2\n", base="local BASE = 0\n")
    source = compose("main", "--#include a\n--#include b\nreturn BASE\n", Layout(), read=read).source
    assert source.count("local BASE = 0") == 1
    assert source.index("local BASE = 0") < source.index("local A = 1") < source.index("local B = 2")


def test_an_unknown_include_is_one_clear_error() -> None:
    with pytest.raises(ScriptError, match="no Lua part named 'nowhere'"):
        compose("main", "--#include nowhere\n", Layout(), read=parts())


def test_a_shipped_script_naming_an_unknown_part_fails_the_same_way() -> None:
    with pytest.raises(ScriptError, match="no Lua part named 'nowhere'"):
        compose("main", "--#include nowhere\n", Layout())


def test_an_include_cycle_is_one_clear_error_naming_it() -> None:
    read = parts(a="--#include b\n", b="--#include a\n")
    with pytest.raises(ScriptError, match="include cycle: main -> a -> b -> a"):
        compose("main", "--#include a\n", Layout(), read=read)


def test_a_layout_packs_by_name_in_its_declared_order() -> None:
    layout = Layout(keys=("k1", "k2"), args=("a", "b"), key_tail="more", arg_tail="rows", row=("x", "y"))
    keys, args = layout.pack({"k2": "K2", "k1": "K1"}, {"b": 2, "a": 1}, ["K3"], [10, 11, 20, 21])
    assert keys == ["K1", "K2", "K3"]
    assert args == [1, 2, 10, 11, 20, 21]
    assert layout.index("b") == 1


def test_a_layout_refuses_a_missing_or_unknown_name_and_a_ragged_tail() -> None:
    layout = Layout(keys=("k",), args=("a", "b"), arg_tail="rows", row=("x", "y"))
    with pytest.raises(ScriptError, match=r"missing \['b'\], unknown \['c'\]"):
        layout.pack({"k": "K"}, {"a": 1, "c": 3})
    with pytest.raises(ScriptError, match="do not fit"):
        layout.pack({"k": "K"}, {"a": 1, "b": 2}, rows=[1, 2, 3])
    with pytest.raises(ScriptError, match="do not fit"):
        layout.pack({"k": "K"}, {"a": 1, "b": 2}, key_tail=["K2"])


@pytest.mark.parametrize("layout", [Layout(args=("end",)), Layout(keys=("a",), args=("a",)),
                                    Layout(args=("ARGV",)), Layout(arg_tail="rows")])
def test_a_layout_name_must_be_a_distinct_lua_name_hiding_nothing(layout: Layout) -> None:
    with pytest.raises(ScriptError):
        compose("main", "return 1\n", layout, read=parts())


def test_constants_are_declared_as_lua_literals() -> None:
    source = compose("main", "return 1\n", Layout(), {"N": 3, "S": "it's", "T": (1, 20)}, read=parts()).source
    assert "local N = 3\n" in source
    assert "local S = 'it\\'s'\n" in source
    assert "local T = {1,20}\n" in source


def test_every_lua_file_is_a_shipped_script_or_a_part_one_includes() -> None:
    files = {f.name.removesuffix(".lua") for f in resources.files("mlxq.api.protocol").joinpath("lua").iterdir()
             if f.name.endswith(".lua")}
    shipped = {s.name for s in SHIPPED}
    included = {line.split()[1] for f in files for line in
                resources.files("mlxq.api.protocol").joinpath("lua", f"{f}.lua").read_text().splitlines()
                if line.startswith("--#include")}
    assert files == shipped | included
    assert {"claim", "share", "outranking", "affinity"} <= files  # CLAIM, in its parts


async def test_redis_accepts_every_shipped_script(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        for script in SHIPPED:
            assert await r.script_load(script.source) == script.sha, script.name
    finally:
        await r.aclose()


async def test_a_script_is_loaded_again_after_redis_forgot_it(redis_url: str) -> None:
    r = aredis.Redis.from_url(redis_url)
    try:
        keys = Keys("reload")
        assert await producer.cancel(r, keys, "nobody") == 0  # first use: NOSCRIPT, loaded, run
        await r.script_flush()
        assert await producer.cancel(r, keys, "nobody") == 0
        assert await r.script_exists(producer.CANCEL.sha) == [True]
    finally:
        await r.aclose()


async def test_names_reach_the_lua_as_locals(redis_url: str) -> None:
    layout = Layout(keys=("k",), args=("a",), key_tail="ks", arg_tail="rows", row=("x", "y"))
    script = compose("probe", "return {k, a, #ks, ks[1], #rows, rows[2].x, rows[2].y, LIMIT}\n", layout,
                     {"LIMIT": 7}, read=parts())
    r = aredis.Redis.from_url(redis_url)
    try:
        got = await script.run(r, {"k": "K"}, {"a": "A"}, ["K2"], ["x1", "y1", "x2", "y2"])
    finally:
        await r.aclose()
    assert got == [b"K", b"A", 1, b"K2", 2, b"x2", b"y2", 7]


@pytest.mark.parametrize("prefix", ["mlxq", "a:b"])
@pytest.mark.parametrize("model", ["m", "org/model-7B:q4", ""])
@pytest.mark.parametrize("tenant", ["default", "acme", "t.1_x-y"])
async def test_the_lua_queue_names_are_keys_names(redis_url: str, prefix: str, model: str, tenant: str) -> None:
    # One format: lua/queues.lua builds and parses names as Keys.queue and Keys.queue_of do.
    probe = ("--#include queues\nlocal m, t = model_tenant(prefix, queue_of(prefix, model, tenant))\n"
             "local pm, pt = model_tenant(prefix, given)\nreturn {queue_of(prefix, model, tenant), m, t, pm, pt}\n")
    script = compose("probe", probe, Layout(args=("prefix", "model", "tenant", "given")))
    keys = Keys(prefix)
    r = aredis.Redis.from_url(redis_url)
    try:
        got = await script.run(r, {}, {"prefix": prefix, "model": model, "tenant": tenant,
                                       "given": keys.queue(model, tenant)})
    finally:
        await r.aclose()
    name, m, t, pm, pt = (v.decode() for v in got)
    assert name == keys.queue(model, tenant)
    assert (m, t) == (pm, pt) == keys.queue_of(name) == (model, tenant)
