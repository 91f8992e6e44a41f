"""OutputProcessor on its own: tokens in, outputs out, and what the engine must apply returned as
data (sequences a stop string ended, sequences and requests over), never applied by it."""

from __future__ import annotations

from octavo.output_processor import OutputProcessor, merge_deltas
from octavo.request import FinishReason, Request, RequestStatus
from octavo.sampling.params import RequestOutputKind, SamplingParams


def _seq(rid: str, prompt: list[int], params: SamplingParams) -> Request:
    return Request(rid, prompt, params, arrival_time=0.0, status=RequestStatus.RUNNING)


def _feed(seq: Request, token: int) -> None:  # what Scheduler.update does to a sequence
    seq.output_token_ids.append(token)
    seq.all_token_ids.append(token)


def test_a_stop_string_ends_the_sequence_as_data_and_the_request_is_forgotten(smol_tokenizer):
    tok = smol_tokenizer
    prompt = tok.encode("Count: one, two,")
    params = SamplingParams(max_tokens=20, stop=("four",), output_kind=RequestOutputKind.DELTA)
    proc = OutputProcessor(tok)
    proc.add_request("r", "Count: one, two,", prompt, params, arrival_time=0.0)
    seq = _seq("r", prompt, params)
    pieces, stopped, ended, finished = [], [], [], []
    for token in tok.encode(" three, four, five", add_special_tokens=False):
        _feed(seq, token)
        result = proc.process([seq])
        pieces += [o.outputs[0].text for o in result.outputs]
        stopped += result.stopped_seq_ids
        ended += result.ended_seq_ids
        finished += result.finished_request_ids
        if result.finished_request_ids:
            break
    assert stopped == ["r"] and ended == ["r"] and finished == ["r"]
    assert seq.status is RequestStatus.RUNNING  # the processor never finishes it: the engine does
    assert "".join(pieces) == " three, " and "r" not in proc and len(proc) == 0


def test_a_finished_sequence_reports_its_reason_once_and_deltas_merge(smol_tokenizer):
    tok = smol_tokenizer
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA, stop_token_ids=(42,))
    proc = OutputProcessor(tok)
    proc.add_request("r", None, [1, 2, 3], params, arrival_time=0.0)
    seq = _seq("r", [1, 2, 3], params)
    outs = []
    for token in (100, 200, 42):
        _feed(seq, token)
        if token == 42:
            seq.status, seq.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
        result = proc.process([seq])
        outs += [(0, o) for o in result.outputs]
        assert not result.stopped_seq_ids  # the scheduler ended it itself
    [(_, merged)] = merge_deltas(outs)
    c = merged.outputs[0]
    assert merged.finished and c.token_ids == [100, 200, 42] and c.finish_reason == "stop" and c.stop_reason == 42
    assert [o.outputs[0].finish_reason for _, o in outs] == [None, None, "stop"]
