"""Batches of ragged prompts: each row accepts its own drafts, stops on its own, and matches plain greedy generate()."""

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB, expected_steps, make_oracle, make_speculator, make_verifier
from tiny_tokenizer import char_tokenizer
from transformers.generation.streamers import BaseStreamer

LENGTHS = [5, 12, 8, 3]


def ragged_batch(lengths=LENGTHS, seed=0):
    """Left-padded prompts of the given lengths and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def greedy(model, input_ids, attention_mask, **kwargs):
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_batched_greedy_equals_plain_batched_greedy(arch):
    verifier, (input_ids, attention_mask) = make_verifier(arch), ragged_batch()
    # Wrong drafts at row-dependent places: every row accepts its own number of drafts each step.
    speculator = make_oracle(verifier, input_ids, 30, attention_mask=attention_mask,
                             wrong=lambda row, position, head: (position + row + head) % 3 == 0)  # fmt: skip
    plain = greedy(verifier, input_ids, attention_mask, max_new_tokens=30)
    output = greedy(verifier, input_ids, attention_mask, max_new_tokens=30, assistant_model=speculator)
    assert torch.equal(output, plain)
    accepted = [m.num_accepted_tokens for m in speculator.speculation_metrics_per_row]
    assert len(set(accepted)) > 1 and min(accepted) > 0


def test_each_row_equals_its_prompt_alone():
    """Padding only reorders floating-point sums; in fp32 on these models the tokens stay identical."""
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    output = greedy(verifier, input_ids, attention_mask, max_new_tokens=20, assistant_model=make_speculator())
    for row, length in enumerate(LENGTHS):
        alone = verifier.generate(input_ids[row : row + 1, -length:], max_new_tokens=20, do_sample=False)
        assert torch.equal(output[row, input_ids.shape[1] :], alone[0, length:])


@pytest.mark.parametrize("n_predict", [1, 3, 5])
def test_every_row_drafts_from_its_own_last_emitted_position(n_predict):
    """Per row, the counts and the states handed to the heads are exactly those of `expected_steps`."""
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    wrong = lambda row, position, head: (position * (row + 1) + head) % 4 == 1  # noqa: E731
    speculator = make_oracle(verifier, input_ids, 25, n_predict=n_predict, attention_mask=attention_mask, wrong=wrong)
    greedy(verifier, input_ids, attention_mask, max_new_tokens=25, assistant_model=speculator)

    visits = speculator.speculator.visits
    for row, metrics in enumerate(speculator.speculation_metrics_per_row):
        steps = expected_steps(input_ids.shape[1], 25, n_predict, lambda p, h, row=row: wrong(row, p, h))
        assert metrics.num_steps == len(steps)
        assert metrics.num_draft_tokens == sum(d for _, d, _ in steps)
        assert metrics.num_accepted_tokens == sum(a for _, _, a in steps)
        # A row with no draft budget left still rides along while other rows draft: its state is looked at, unused.
        seen = [p for r, p in visits if r == row]
        assert seen == [p for p, _, _ in steps][: len(seen)]
        assert len(seen) >= sum(1 for _, drafted, _ in steps if drafted)
    total = speculator.speculation_metrics
    assert total.num_accepted_tokens == sum(m.num_accepted_tokens for m in speculator.speculation_metrics_per_row)


def test_rows_stop_at_their_own_eos():
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    plain = greedy(verifier, input_ids, attention_mask, max_new_tokens=24)
    # An EOS id that rows reach at different steps, while some row never reaches it.
    eos, first = next(
        (eos, first)
        for eos in range(1, VOCAB)
        for first in [[row.index(eos) if eos in row else None for row in plain[:, input_ids.shape[1] :].tolist()]]
        if None in first and len({f for f in first if f is not None}) > 1
    )

    speculator = make_oracle(verifier, input_ids, 24, attention_mask=attention_mask,
                             wrong=lambda row, position, head: head == 2)  # fmt: skip
    kwargs = dict(max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    expected = greedy(verifier, input_ids, attention_mask, **kwargs)
    output = greedy(verifier, input_ids, attention_mask, assistant_model=speculator, **kwargs)
    assert torch.equal(output, expected)
    for row, stop in enumerate(first):
        if stop is not None:  # nothing but padding after the row's EOS
            assert output[row, input_ids.shape[1] + stop] == eos
            assert (output[row, input_ids.shape[1] + stop + 1 :] == 0).all()


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value)

    def end(self):
        self.ended = True


def test_streamer_gets_whole_batches_in_row_order():
    """As from plain batched generate(): every chunk holds all rows in order; together they are the output."""
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    plain = greedy(verifier, input_ids, attention_mask, max_new_tokens=20)
    new_tokens = plain[:, input_ids.shape[1] :].tolist()
    eos = next(eos for eos in range(1, VOCAB) if 0 < sum(eos in row for row in new_tokens) < len(LENGTHS))  # some rows
    kwargs = dict(max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    plain_streamer, streamer = Collect(), Collect()
    expected = greedy(verifier, input_ids, attention_mask, streamer=plain_streamer, **kwargs)
    speculator = make_oracle(verifier, input_ids, 20, attention_mask=attention_mask,
                             wrong=lambda row, position, head: (position + row + head) % 3 == 0)  # fmt: skip
    output = greedy(verifier, input_ids, attention_mask, assistant_model=speculator, streamer=streamer, **kwargs)
    assert torch.equal(output, expected)
    # Plain generate() streams the prompt, then one (batch,) column per step, padding the rows that finished.
    assert torch.equal(torch.cat([plain_streamer.chunks[0], *[c[:, None] for c in plain_streamer.chunks[1:]]], 1),
                       expected)  # fmt: skip
    assert all(chunk.shape[0] == len(LENGTHS) for chunk in streamer.chunks) and streamer.ended
    assert torch.equal(torch.cat(streamer.chunks, dim=1), expected)
    assert len(streamer.chunks) < len(plain_streamer.chunks)  # several tokens per chunk where drafts were accepted


def test_each_row_stops_its_chain_at_an_unsure_draft():
    """`assistant_confidence_threshold` per row: head 1 is unsure (p = 0.73) on even rows only."""
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    speculator = make_oracle(verifier, input_ids, 20, attention_mask=attention_mask,
                             wrong=lambda row, position, head: head == 1 and row % 2 == 0)  # fmt: skip
    output = greedy(verifier, input_ids, attention_mask, max_new_tokens=20, assistant_model=speculator,
                    assistant_confidence_threshold=0.8)  # fmt: skip
    assert torch.equal(output, greedy(verifier, input_ids, attention_mask, max_new_tokens=20))
    for row, metrics in enumerate(speculator.speculation_metrics_per_row):
        assert len(metrics.head_draft_tokens) == (2 if row % 2 == 0 else 3)
        assert metrics.head_acceptance_rates[:2] == ([1.0, 0.0] if row % 2 == 0 else [1.0, 1.0])


def test_return_dict_in_generate():
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch([4, 7])
    speculator = make_speculator()
    output = greedy(verifier, input_ids, attention_mask, max_new_tokens=6, assistant_model=speculator,
                    return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(output.sequences, greedy(verifier, input_ids, attention_mask, max_new_tokens=6))


@pytest.mark.parametrize("lengths", [[7], [4, 7]])
def test_num_return_sequences(lengths):
    """Each prompt's sequences in a row, as from plain generate(); top_k=1 makes every sample the greedy one."""
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch(lengths)
    speculator = make_oracle(verifier, input_ids, 12, attention_mask=attention_mask,
                             wrong=lambda row, position, head: (position + head) % 3 == 0)  # fmt: skip
    kwargs = dict(max_new_tokens=12, do_sample=True, top_k=1, num_return_sequences=3)
    output = verifier.generate(input_ids, attention_mask=attention_mask, assistant_model=speculator, **kwargs)
    assert torch.equal(output, verifier.generate(input_ids, attention_mask=attention_mask, **kwargs))
    expected = greedy(verifier, input_ids, attention_mask, max_new_tokens=12).repeat_interleave(3, dim=0)
    assert torch.equal(output, expected)
    assert len(speculator.speculation_metrics_per_row) == 3 * len(lengths)
    assert all(m.num_accepted_tokens > 0 for m in speculator.speculation_metrics_per_row)


def test_batch_with_processors_matches_plain():
    """Processors that read each row's tokens (repetition penalty, min_new_tokens) see each row as plain does."""
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    kwargs = dict(max_new_tokens=16, repetition_penalty=1.5, min_new_tokens=5, eos_token_id=7, pad_token_id=0)
    speculator = make_oracle(verifier, input_ids, 16, attention_mask=attention_mask)
    expected = greedy(verifier, input_ids, attention_mask, **kwargs)
    assert torch.equal(greedy(verifier, input_ids, attention_mask, assistant_model=speculator, **kwargs), expected)


def test_stop_strings_on_a_batch_and_a_tree():
    """generate() keeps the tokenizer from a custom decoding loop; the stop-string criterion must reach it anyway."""
    verifier, (input_ids, attention_mask) = make_verifier(), ragged_batch()
    tokenizer = char_tokenizer()
    plain = greedy(verifier, input_ids, attention_mask, max_new_tokens=16)[:, input_ids.shape[1] :]
    # A character that one row generates early while another never does, so rows stop at different steps.
    texts = [tokenizer.decode(row) for row in plain.tolist()]
    stop = next(c for c in texts[0][2:] if any(c not in text for text in texts))
    # With an EOS criterion (an id never generated here), plain generate() pads the rows that stopped, as ours does.
    eos = next(token for token in range(1, VOCAB) if token not in plain)
    kwargs = dict(max_new_tokens=16, stop_strings=[stop], tokenizer=tokenizer, eos_token_id=eos, pad_token_id=0)
    expected = greedy(verifier, input_ids, attention_mask, **kwargs)
    assert (expected[:, -1] == 0).any()  # the stop string did stop a row
    for tree in ({}, {"n_candidates": 2}):
        output = greedy(verifier, input_ids, attention_mask, assistant_model=make_speculator(), **kwargs, **tree)
        assert torch.equal(output, expected)
        alone = verifier.generate(input_ids[:1], max_new_tokens=16, do_sample=False, stop_strings=[stop],
                                  tokenizer=tokenizer, assistant_model=make_speculator(), **tree)  # fmt: skip
        assert tokenizer.decode(alone[0, input_ids.shape[1] :]).endswith(stop)
