"""Structured output in the engine: the contract, the step's token masks, and generation on a
tiny random checkpoint with SmolLM2's tokenizer. A random model's tokens go anywhere, so
every constrained output that holds is the masks' doing: sampled at temperature 1 over many
seeds, each output validates against its JSON schema (jsonschema) or matches its regex
(re.fullmatch), also in a batch with unconstrained requests, resumed mid-object on another
engine, and with speculation on."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch

from common.contract.sampling import SamplingParams
from common.contract.structured import (
    MAX_CONSTRAINT_CHARS,
    ConstraintKind,
    StructuredOutput,
)
from common.engine.engine import Engine
from common.engine.grammar import apply_masks, step_masks
from common.errors import InvalidRequestError
from pdserve.common.v1 import common_pb2
from tests.factories import make_tiny_checkpoint, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 49152  # SmolLM2's
PROMPT = [1, 504, 3458, 282, 216, 2078]  # any ids: the random model ignores meaning

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    "nested_anyof_pattern": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "owner": {
                "type": "object",
                "properties": {
                    "kind": {"const": "user"},
                    "level": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9},
                                        {"enum": ["admin", "guest"]}]},
                },
                "required": ["kind", "level"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "owner"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A random llama over SmolLM2's vocabulary, with SmolLM2's tokenizer beside it."""
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("structured"), vocab_size=VOCAB, seed=7, eos_token_id=2
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return tiny_engine(model_dir)


def schema_of(schema: dict) -> StructuredOutput:
    return StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
        **kwargs: object) -> dict[str, tuple[list[int], str | None]]:  # fmt: skip
    """Every request in one batch, to the end: (output tokens, finish reason) by id."""
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(request_id, prompt, sampling, **kwargs)  # type: ignore[arg-type]
    out: dict[str, tuple[list[int], str | None]] = {r: ([], None) for r in requests}
    while engine.has_unfinished():
        for step in engine.step():
            tokens, _ = out[step.request_id]
            tokens += step.new_token_ids
            if step.finish_reason is not None:
                out[step.request_id] = (tokens, step.finish_reason.value)
    return out


def text_of(engine: Engine, tokens: list[int]) -> str:
    hf = engine.grammars.tokenizer()
    return str(hf.decode_str([t for t in tokens if t != 2]))


# -- the contract -----------------------------------------------------------------------------


def test_each_kind_travels_through_the_contract() -> None:
    for constraint in (
        schema_of(SCHEMAS["flat"]),
        StructuredOutput(ConstraintKind.JSON_OBJECT),
        StructuredOutput(ConstraintKind.REGEX, "[0-9]{3}"),
        StructuredOutput(ConstraintKind.GRAMMAR, 'start: "a" | "b"'),
    ):
        sampling = SamplingParams(max_tokens=8, structured_output=constraint)
        pb = sampling.to_pb(common_pb2.SamplingParams())
        assert pb.structured_output.WhichOneof("constraint") == constraint.kind.value
        assert SamplingParams.from_pb(pb, 8).structured_output == constraint
        constraint.check()
    plain = SamplingParams(max_tokens=8).to_pb(common_pb2.SamplingParams())
    assert not plain.HasField("structured_output")
    assert SamplingParams.from_pb(plain, 8).structured_output is None


def test_rejected_constraints_name_the_field_with_llguidance_s_message() -> None:
    with pytest.raises(InvalidRequestError, match=r"(?s)structured_output\.regex.*unclosed"):
        StructuredOutput(ConstraintKind.REGEX, "[a-z").check()
    with pytest.raises(InvalidRequestError, match=r"structured_output\.json_schema.*not JSON"):
        StructuredOutput(ConstraintKind.JSON_SCHEMA, "{nope").check()
    with pytest.raises(InvalidRequestError, match=r"structured_output\.json_schema"):
        schema_of({"type": "objekt"}).check()
    with pytest.raises(InvalidRequestError, match=r"structured_output\.grammar"):
        StructuredOutput(ConstraintKind.GRAMMAR, "start: undefined_rule").check()
    with pytest.raises(InvalidRequestError, match="at most"):
        StructuredOutput(ConstraintKind.REGEX, "a" * (MAX_CONSTRAINT_CHARS + 1))
    # Past the compiler's limits: refused at once, never left to a worker.
    deep = '{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300
    with pytest.raises(InvalidRequestError, match="recursion limit"):
        StructuredOutput(ConstraintKind.JSON_SCHEMA, deep).check()
    pb = common_pb2.SamplingParams(max_tokens=4)
    pb.structured_output.regex = "a" * (MAX_CONSTRAINT_CHARS + 1)
    with pytest.raises(InvalidRequestError, match=r"structured_output\.regex"):
        SamplingParams.check_pb_sizes(pb)  # before anything else is read


def test_gbnf_is_recognised_and_converted() -> None:
    gbnf = 'root ::= "yes" | "no"'
    constraint = StructuredOutput(ConstraintKind.GRAMMAR, gbnf)
    constraint.check()
    lark = StructuredOutput(ConstraintKind.GRAMMAR, 'start: "yes" | "no"')
    assert constraint.key != lark.key or constraint.grammar == lark.grammar


# -- masks ------------------------------------------------------------------------------------


def test_masks_allow_exactly_the_tokens_the_constraint_can_take(engine: Engine) -> None:
    state = engine.grammars.compile(StructuredOutput(ConstraintKind.REGEX, "(yes|no)"))
    masks = step_masks([(state, 1, [])], 3, VOCAB)
    logits = apply_masks(torch.zeros(3, VOCAB), masks, [1])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()  # other rows
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    tokenizer = engine.grammars.tokenizer()
    texts = {tokenizer.decode_str([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert {"yes", "no"} <= texts or {"y", "n"} <= texts


def test_verify_rows_see_the_drafts_before_them_and_the_matcher_rolls_back(
    engine: Engine,
) -> None:
    tokenizer = engine.grammars.tokenizer()
    state = engine.grammars.compile(StructuredOutput(ConstraintKind.REGEX, "[ab]+c"))
    a, b, c, z = (tokenizer.tokenize_str(s)[0] for s in ("a", "b", "c", "z"))
    masks = step_masks([(state, 0, [a, b, z])], 4, VOCAB)
    allowed = [torch.isfinite(apply_masks(torch.zeros(4, VOCAB), masks, [j])[j]) for j in range(4)]
    assert allowed[0][a] and allowed[0][b] and not allowed[0][c]
    assert allowed[1][c] and allowed[2][c]  # after the draft "a", and after "ab"
    assert not allowed[2][z]  # "z" is refused, so the row after it repeats
    assert torch.equal(masks[3], masks[2])
    assert not state.advance(c)  # rolled back: still at the start, where c is refused


# -- generation -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_output_validates_against_its_schema(engine: Engine, name: str) -> None:
    schema = SCHEMAS[name]
    constraint = schema_of(schema)
    requests = {
        f"{name}-{seed}": (PROMPT, SamplingParams(max_tokens=160, temperature=1.0, seed=seed,
                                                  structured_output=constraint))
        for seed in range(12)
    }
    for request_id, (tokens, finish) in run(engine, requests).items():
        text = text_of(engine, tokens)
        assert finish == "stop", (request_id, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_grammar_outputs_match(engine: Engine) -> None:
    cases = {
        "regex": (StructuredOutput(ConstraintKind.REGEX, r"[A-Z][a-z]{2,5}-[0-9]{2}"),
                  r"[A-Z][a-z]{2,5}-[0-9]{2}"),
        "lark": (StructuredOutput(ConstraintKind.GRAMMAR,
                                  'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/'),
                 r"\([0-9]{1,2}(,[0-9]{1,2})*\)"),
        "gbnf": (StructuredOutput(ConstraintKind.GRAMMAR, 'root ::= ("ab" | "cd")+ "."'),
                 r"(ab|cd)+\."),
    }  # fmt: skip
    requests = {
        f"{name}-{seed}": (PROMPT, SamplingParams(max_tokens=64, temperature=1.0, seed=seed,
                                                  structured_output=constraint))
        for name, (constraint, _) in cases.items()
        for seed in range(8)
    }
    for request_id, (tokens, finish) in run(engine, requests).items():
        pattern = cases[request_id.rsplit("-", 1)[0]][1]
        text = text_of(engine, tokens)
        if finish == "stop":
            assert re.fullmatch(pattern, text), (request_id, text)
        else:  # max_tokens inside an unbounded repetition: a prefix of a match
            assert finish == "length" and request_id.startswith(("lark", "gbnf")), text


def test_constrained_and_unconstrained_requests_share_a_batch(engine: Engine) -> None:
    plain = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    alone = run(engine, {"alone": (PROMPT, plain)})["alone"]
    constraint = schema_of(SCHEMAS["flat"])
    batch = run(engine, {
        "plain": (PROMPT, plain),
        "json": (PROMPT, SamplingParams(max_tokens=160, temperature=1.0, seed=5,
                                        structured_output=constraint)),
    })  # fmt: skip
    assert batch["plain"] == alone  # the constrained neighbour changes nothing
    tokens, finish = batch["json"]
    assert finish == "stop"
    jsonschema.validate(json.loads(text_of(engine, tokens)), SCHEMAS["flat"])
    assert engine.grammars.stats.num_mask_steps > 0


def test_a_resumed_request_replays_its_tokens_and_ends_as_undisturbed(
    engine: Engine, model_dir: Path
) -> None:
    """Migration mid-object: another engine gets the prompt and the tokens so far, rebuilds
    the matcher from them, and finishes with the undisturbed seeded run's tokens."""
    constraint = schema_of(SCHEMAS["nested_anyof_pattern"])
    sampling = SamplingParams(max_tokens=160, temperature=1.0, seed=11,
                              structured_output=constraint)  # fmt: skip
    whole, finish = run(engine, {"whole": (PROMPT, sampling)})["whole"]
    assert finish == "stop" and len(whole) > 6
    other = tiny_engine(model_dir)
    cut = len(whole) // 2
    rest = run(other, {"resumed": (PROMPT, sampling)}, output_token_ids=whole[:cut])["resumed"]
    assert whole[:cut] + rest[0] == whole and rest[1] == "stop"
    # Tokens the constraint refuses cannot be replayed onto it.
    bad = engine.grammars.tokenizer().tokenize_str("nope")
    with pytest.raises(InvalidRequestError, match="do not satisfy"):
        other.add_request("bad", PROMPT, sampling, output_token_ids=bad)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_on_and_off_give_the_same_constrained_output(
    model_dir: Path, temperature: float, method: str
) -> None:
    if method == "suffix":
        pytest.importorskip("arctic_inference.suffix_decoding", reason="scripts/setup.sh builds it")
        spec = json.dumps({"method": "suffix", "num_speculative_tokens": 3, "adaptive": False,
                           "suffix_decoding_max_spec_factor": 2})  # fmt: skip
    else:
        spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False})  # fmt: skip
    constraint = StructuredOutput(ConstraintKind.REGEX, r"(ab|abc|b){6,12}")
    # A prompt full of the pattern's text, so prompt lookup proposes often.
    tokenizer_engine = tiny_engine(model_dir)
    prompt = tokenizer_engine.grammars.tokenizer().tokenize_str("ab abc b ab abc b ab ab")
    requests = {
        f"s{seed}": (prompt, SamplingParams(max_tokens=40, temperature=temperature, seed=seed,
                                            structured_output=constraint))
        for seed in range(6)
    }
    plain = run(tokenizer_engine, requests)
    speculating = tiny_engine(model_dir, speculative_config=spec)
    assert run(speculating, requests) == plain
    assert speculating.spec_stats.num_draft_tokens > 0  # it did speculate
    for tokens, finish in plain.values():
        assert finish == "stop"
        assert re.fullmatch(r"(ab|abc|b){6,12}", text_of(speculating, tokens))
