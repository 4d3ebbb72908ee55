"""Generation tests for every causal family and the Llama control, after transformers' ``GenerationTesterMixin``
(``tests/generation/test_utils.py``, which the sdist does not ship): the same test names and logic, written for the
transformers 5.24 API (the ``cache`` argument and output field), and, where upstream checks only shapes, also the
values: every cached decoding path is compared with full forwards of the sequence it produced.

A test class inherits it after ``ModelTesterMixin`` (``upstream.py`` also hands it to that module as
``generation.test_utils.GenerationTesterMixin``). Everything runs in float32 on the CPU; logits are compared at
1e-5 (float32 rounding of a few-layer decoder, where a cached and an uncached pass sum in different orders).
"""

import copy
import inspect

import pytest
import torch
from transformers import DynamicCache, GenerationMixin, StaticCache
from transformers.generation import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

RTOL = ATOL = 1e-5


class GenerationTesterMixin:
    """Generation tests over ``self.all_generative_model_classes`` (the model classes that can generate)."""

    max_new_tokens = 3

    # ----------------------------------------------------------------------------------------------------------
    # Family hooks: what a family's outputs look like where it differs from Llama by design
    # ----------------------------------------------------------------------------------------------------------

    def attention_key_length(self, config, layer_idx: int, kv_length: int) -> int:
        """The last dimension of layer ``layer_idx``'s attention weights when the cache holds ``kv_length`` tokens
        (Llama: the cached tokens; MoDA adds its depth entries)."""
        return kv_length

    def hidden_state_shape(self, config, index: int, batch_size: int, length: int) -> tuple:
        """The shape of ``hidden_states[index]`` for ``length`` new tokens (Llama: [B, T, D]; mHC: [B, T, n, D] for
        the residual streams before the final collapse)."""
        return (batch_size, length, config.hidden_size)

    # ----------------------------------------------------------------------------------------------------------
    # Helpers
    # ----------------------------------------------------------------------------------------------------------

    def prepare_config_and_inputs_for_generate(self, batch_size: int = 2):
        """A config that never stops early (no eos) and a prompt [batch_size, T] with a full attention mask."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        input_ids = inputs["input_ids"][:batch_size]
        config.eos_token_id = None
        config.forced_eos_token_id = None
        return config, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    def _model(self, model_class, config, attn_implementation: str | None = None):
        config = copy.deepcopy(config)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        model = model_class(config).eval()
        model.generation_config.pad_token_id = config.pad_token_id
        model.generation_config.eos_token_id = config.eos_token_id
        return model

    @staticmethod
    def _logits_processor_kwargs(do_sample: bool = False) -> dict:
        """upstream's: a few logits processors (and warpers when sampling) that every decoding path must apply."""
        kwargs = {"bad_words_ids": [[1, 0]], "repetition_penalty": 1.2, "remove_invalid_values": True}
        if do_sample:
            kwargs.update(top_k=10, top_p=0.7, temperature=0.7)
        return kwargs

    @staticmethod
    def _beam_kwargs(num_return_sequences: int = 1) -> dict:
        return {"early_stopping": False, "length_penalty": 2.0, "num_beams": 2,
                "num_return_sequences": num_return_sequences}

    def _generate(self, model, inputs: dict, **kwargs):
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=kwargs.pop("max_new_tokens", self.max_new_tokens), **kwargs)

    def _full_forward_logits(self, model, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """The logits [B, L, V] of one uncached forward over ``sequences`` (positions from the mask, as generate)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(sequences)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            return model(sequences, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits

    def _check_logits_equal_full_forward(self, model, output, prompt_length: int, attention_mask=None):
        """Each step's raw logits (``output_logits``) equal an uncached forward over the generated sequence."""
        steps = len(output.logits)
        mask = None
        if attention_mask is not None:
            new_tokens = output.sequences.shape[1] - prompt_length
            mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], new_tokens)], dim=-1)
        full = self._full_forward_logits(model, output.sequences, mask)
        for step in range(steps):
            torch.testing.assert_close(output.logits[step], full[:, prompt_length - 1 + step], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, step=step: f"generation step {step}: {m}")

    def _check_similar_generate_outputs(self, output_1, output_2):
        """upstream's rule: the sequences are equal, or the scores agree up to and including the first mismatch
        (a near tie that rounding may break either way)."""
        prompt_length = output_1.sequences.shape[1] - len(output_1.scores)
        matches = output_1.sequences == output_2.sequences
        for row in range(matches.shape[0]):
            if matches[row].all():
                continue
            first = int(matches[row].int().argmin()) - prompt_length
            for step in range(first + 1):
                torch.testing.assert_close(output_1.scores[step][row], output_2.scores[step][row], rtol=RTOL,
                                           atol=ATOL)

    def _check_generate_outputs(self, output, config, prompt_length: int, batch_size: int, use_cache: bool,
                                num_return_sequences: int = 1, num_beams: int = 1):
        """upstream's ``_check_outputs``: the output class, and the scores, logits, attentions and hidden states of
        every step with their shapes."""
        rows = batch_size * num_return_sequences
        internal = batch_size * max(num_beams, num_return_sequences)  # the batch generate runs with
        self.assertIsInstance(output, GenerateBeamDecoderOnlyOutput if num_beams > 1 else GenerateDecoderOnlyOutput)
        self.assertEqual(output.sequences.shape, (rows, prompt_length + self.max_new_tokens))
        vocab = config.vocab_size
        self.assertEqual(len(output.scores), self.max_new_tokens)
        self.assertEqual(len(output.logits), self.max_new_tokens)
        for step in range(self.max_new_tokens):
            self.assertEqual(output.scores[step].shape, (internal, vocab))
            self.assertEqual(output.logits[step].shape, (internal, vocab))
        if num_beams > 1:
            self.assertEqual(output.sequences_scores.shape, (rows,))
            self.assertEqual(output.beam_indices.shape, (rows, self.max_new_tokens))
        self.assertEqual(len(output.attentions), self.max_new_tokens)
        self.assertEqual(len(output.hidden_states), self.max_new_tokens)
        for step in range(self.max_new_tokens):
            kv_length = prompt_length + step
            query_length = 1 if use_cache and step > 0 else kv_length
            attentions, hidden_states = output.attentions[step], output.hidden_states[step]
            self.assertEqual(len(attentions), config.num_hidden_layers)
            for layer, weights in enumerate(attentions):
                self.assertEqual(weights.shape, (internal, config.num_attention_heads, query_length,
                                                 self.attention_key_length(config, layer, kv_length)))
            self.assertEqual(len(hidden_states), config.num_hidden_layers + 1)
            for index, state in enumerate(hidden_states):
                self.assertEqual(state.shape, self.hidden_state_shape(config, index, internal, query_length))
        if use_cache:
            self._check_cache(output.cache, config, internal, prompt_length + self.max_new_tokens - 1)
        else:
            self.assertIsNone(output.cache)

    def _check_cache(self, cache, config, batch_size: int, length: int, cache_class=DynamicCache):
        """A ``Cache`` object (never legacy tuples) of ``cache_class`` with one layer per decoder layer, each holding
        keys and values [B, num_key_value_heads, length, head_dim]."""
        self.assertIsInstance(cache, cache_class)
        self.assertEqual(len(cache.layers), config.num_hidden_layers)
        self.assertEqual(cache.get_seq_length(), length)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        for layer in cache.layers:
            if cache_class is StaticCache:  # preallocated to the cache's maximum length
                self.assertEqual(layer.keys.shape, (batch_size, kv_heads, cache.get_max_length(), head_dim))
            else:
                self.assertEqual(layer.keys.shape, (batch_size, kv_heads, length, head_dim))
                self.assertEqual(layer.values.shape, (batch_size, kv_heads, length, head_dim))

    # ----------------------------------------------------------------------------------------------------------
    # Greedy
    # ----------------------------------------------------------------------------------------------------------

    @pytest.mark.generate
    def test_inherits_generation_mixin(self):
        for model_class in self.all_generative_model_classes:
            self.assertTrue(issubclass(model_class, GenerationMixin))

    @pytest.mark.generate
    def test_greedy_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            output = self._generate(model, inputs, do_sample=False, num_beams=1, **self._logits_processor_kwargs())
            self.assertEqual(output.shape, (2, inputs["input_ids"].shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(output[:, : inputs["input_ids"].shape[1]], inputs["input_ids"]))

    @pytest.mark.generate
    def test_greedy_generate_dict_outputs(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config, "eager")  # output_attentions needs the eager attention
            output = self._generate(model, inputs, do_sample=False, num_beams=1, use_cache=False,
                                    output_scores=True, output_logits=True, output_attentions=True,
                                    output_hidden_states=True, return_dict_in_generate=True,
                                    **self._logits_processor_kwargs())
            self._check_generate_outputs(output, config, inputs["input_ids"].shape[1], 2, use_cache=False)

    @pytest.mark.generate
    def test_greedy_generate_dict_outputs_use_cache(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config, "eager")
            kwargs = dict(do_sample=False, num_beams=1, output_scores=True, output_logits=True,
                          output_attentions=True, output_hidden_states=True, return_dict_in_generate=True,
                          **self._logits_processor_kwargs())
            cached = self._generate(model, inputs, use_cache=True, **kwargs)
            self._check_generate_outputs(cached, config, inputs["input_ids"].shape[1], 2, use_cache=True)
            uncached = self._generate(model, inputs, use_cache=False, **kwargs)
            self._check_similar_generate_outputs(cached, uncached)

    @pytest.mark.generate
    def test_greedy_generate_logits_equal_full_forward(self):
        """Cached greedy decoding: every step's logits equal an uncached forward over the sequence (and the
        uncached generate gives the same)."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            for use_cache in (True, False):
                output = self._generate(model, inputs, do_sample=False, output_logits=True, output_scores=True,
                                        return_dict_in_generate=True, use_cache=use_cache, max_new_tokens=5)
                self._check_logits_equal_full_forward(model, output, inputs["input_ids"].shape[1])
                self.assertTrue(torch.equal(output.sequences[:, -5:], torch.stack(output.logits, 1).argmax(-1)))

    # ----------------------------------------------------------------------------------------------------------
    # Sampling
    # ----------------------------------------------------------------------------------------------------------

    @pytest.mark.generate
    def test_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            runs = []
            for _ in range(2):
                torch.manual_seed(0)
                runs.append(self._generate(model, inputs, do_sample=True, num_beams=1, num_return_sequences=1,
                                           **self._logits_processor_kwargs(do_sample=True)))
            self.assertEqual(runs[0].shape, (2, inputs["input_ids"].shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(runs[0], runs[1]), "the same seed gave different samples")

    @pytest.mark.generate
    def test_sample_generate_dict_output(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config, "eager")
            torch.manual_seed(0)
            output = self._generate(model, inputs, do_sample=True, num_beams=1, num_return_sequences=2,
                                    use_cache=True, output_scores=True, output_logits=True, output_attentions=True,
                                    output_hidden_states=True, return_dict_in_generate=True,
                                    **self._logits_processor_kwargs(do_sample=True))
            self._check_generate_outputs(output, config, inputs["input_ids"].shape[1], 2, use_cache=True,
                                         num_return_sequences=2)
            # the raw logits are the model's, whatever was sampled
            self._check_logits_equal_full_forward(model, output, inputs["input_ids"].shape[1])

    # ----------------------------------------------------------------------------------------------------------
    # Beam search and beam sampling
    # ----------------------------------------------------------------------------------------------------------

    @pytest.mark.generate
    def test_beam_search_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            output = self._generate(model, inputs, do_sample=False, **self._beam_kwargs(),
                                    **self._logits_processor_kwargs())
            self.assertEqual(output.shape, (2, inputs["input_ids"].shape[1] + self.max_new_tokens))

    @pytest.mark.generate
    def test_beam_search_generate_dict_output(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config, "eager")
            output = self._generate(model, inputs, do_sample=False, use_cache=False, output_scores=True,
                                    output_logits=True, output_attentions=True, output_hidden_states=True,
                                    return_dict_in_generate=True, **self._beam_kwargs(num_return_sequences=2),
                                    **self._logits_processor_kwargs())
            self._check_generate_outputs(output, config, inputs["input_ids"].shape[1], 2, use_cache=False,
                                         num_return_sequences=2, num_beams=2)

    @pytest.mark.generate
    def test_beam_search_generate_dict_outputs_use_cache(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config, "eager")
            kwargs = dict(do_sample=False, output_scores=True, output_logits=True, output_attentions=True,
                          output_hidden_states=True, return_dict_in_generate=True, **self._beam_kwargs(),
                          **self._logits_processor_kwargs())
            cached = self._generate(model, inputs, use_cache=True, **kwargs)
            self._check_generate_outputs(cached, config, inputs["input_ids"].shape[1], 2, use_cache=True,
                                         num_beams=2)
            uncached = self._generate(model, inputs, use_cache=False, **kwargs)
            self._check_similar_generate_outputs(cached, uncached)

    @pytest.mark.generate
    def test_beam_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            runs = []
            for _ in range(2):
                torch.manual_seed(0)
                runs.append(self._generate(model, inputs, do_sample=True, **self._beam_kwargs(),
                                           **self._logits_processor_kwargs(do_sample=True)))
            self.assertEqual(runs[0].shape, (2, inputs["input_ids"].shape[1] + self.max_new_tokens))
            self.assertTrue(torch.equal(runs[0], runs[1]), "the same seed gave different beam samples")

    @pytest.mark.generate
    def test_beam_sample_generate_dict_output(self):
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config, "eager")
            torch.manual_seed(0)
            output = self._generate(model, inputs, do_sample=True, use_cache=True, output_scores=True,
                                    output_logits=True, output_attentions=True, output_hidden_states=True,
                                    return_dict_in_generate=True, **self._beam_kwargs(num_return_sequences=2),
                                    **self._logits_processor_kwargs(do_sample=True))
            self._check_generate_outputs(output, config, inputs["input_ids"].shape[1], 2, use_cache=True,
                                         num_return_sequences=2, num_beams=2)

    @pytest.mark.generate
    def test_num_return_sequences(self):
        """Greedy beams and sampling return ``num_return_sequences`` rows per prompt, each starting with it."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            prompt = inputs["input_ids"]
            for kwargs in (dict(do_sample=False, num_beams=3), dict(do_sample=True, num_beams=1)):
                output = self._generate(model, inputs, num_return_sequences=3, **kwargs)
                self.assertEqual(output.shape, (6, prompt.shape[1] + self.max_new_tokens))
                self.assertTrue(torch.equal(output[:, : prompt.shape[1]], prompt.repeat_interleave(3, dim=0)))

    # ----------------------------------------------------------------------------------------------------------
    # Lengths and stopping
    # ----------------------------------------------------------------------------------------------------------

    @pytest.mark.generate
    def test_generate_without_input_ids(self):
        """From the bos token alone (no prompt)."""
        for model_class in self.all_generative_model_classes:
            config, _ = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            with torch.no_grad():
                output = model.generate(do_sample=False, max_new_tokens=self.max_new_tokens,
                                        remove_invalid_values=True)
            self.assertEqual(output.shape, (1, 1 + self.max_new_tokens))
            self.assertEqual(int(output[0, 0]), config.bos_token_id)

    @pytest.mark.generate
    def test_generate_max_and_min_new_tokens(self):
        """``max_new_tokens`` is the number of new tokens (and equals ``max_length`` = prompt + that); with an eos
        token that greedy decoding would emit first, ``min_new_tokens`` forbids it for that many tokens."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            prompt_length = inputs["input_ids"].shape[1]
            for new_tokens in (1, 4):
                by_new = self._generate(model, inputs, do_sample=False, max_new_tokens=new_tokens)
                by_length = self._generate(model, inputs, do_sample=False, max_new_tokens=None,
                                           max_length=prompt_length + new_tokens)
                self.assertEqual(by_new.shape, (2, prompt_length + new_tokens))
                self.assertTrue(torch.equal(by_new, by_length))
            eos = int(self._generate(model, inputs, do_sample=False, max_new_tokens=1)[0, -1])
            stop_kwargs = dict(do_sample=False, max_new_tokens=4, eos_token_id=eos, pad_token_id=config.pad_token_id)
            stopped = self._generate(model, inputs, **stop_kwargs)
            self.assertEqual(int(stopped[0, prompt_length]), eos)  # without min_new_tokens row 0 stops at once
            self.assertTrue(bool((stopped[0, prompt_length + 1:] == config.pad_token_id).all()))
            held = self._generate(model, inputs, min_new_tokens=3, **stop_kwargs)
            self.assertEqual(held.shape[1], prompt_length + 4)
            self.assertFalse(bool((held[:, prompt_length: prompt_length + 3] == eos).any()),
                             f"eos {eos} within the first 3 new tokens: {held[:, prompt_length:]}")

    @pytest.mark.generate
    def test_eos_token_id_int_and_list_greedy_search(self):
        """Generation stops a row at its eos token (an int or one of a list) and pads the rows that finished."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            prompt_length = inputs["input_ids"].shape[1]
            free = self._generate(model, inputs, do_sample=False, max_new_tokens=6)
            eos = int(free[0, prompt_length + 1])  # row 0's second new token
            stop = next(i for i in range(6) if int(free[0, prompt_length + i]) == eos)
            unused = next(t for t in range(3, config.vocab_size) if t not in free[0, prompt_length:].tolist())
            for eos_token_id in (eos, [eos, unused]):
                output = self._generate(model, inputs, do_sample=False, max_new_tokens=6, eos_token_id=eos_token_id,
                                        pad_token_id=config.pad_token_id)
                self.assertTrue(torch.equal(output[0, : prompt_length + stop + 1], free[0, : prompt_length + stop + 1]))
                tail = output[0, prompt_length + stop + 1:]
                self.assertTrue(bool((tail == config.pad_token_id).all()), f"row 0 went on after eos: {tail}")

    # ----------------------------------------------------------------------------------------------------------
    # Padding, inputs_embeds, caches
    # ----------------------------------------------------------------------------------------------------------

    @pytest.mark.generate
    def test_left_padding_compatibility(self):
        """upstream's: the next-token logits of a prompt are the same behind 32 left-padding tokens; and greedy
        generation of a left-padded batch gives each row what it gives alone, unpadded."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            input_ids, mask = inputs["input_ids"], inputs["attention_mask"]
            unpadded = self._full_forward_logits(model, input_ids, mask)[:, -1]
            padding = torch.full((input_ids.shape[0], 32), config.pad_token_id, dtype=input_ids.dtype)
            padded_ids = torch.cat([padding, input_ids], dim=1)
            padded_mask = torch.cat([torch.zeros_like(padding), mask], dim=1)
            padded = self._full_forward_logits(model, padded_ids, padded_mask)[:, -1]
            torch.testing.assert_close(unpadded, padded, rtol=RTOL, atol=ATOL)

            # A batch of a 4-token and a 7-token prompt, the short one left-padded, against each alone.
            long_prompt = input_ids[1]
            short_prompt = input_ids[0, -4:]
            batch_ids = torch.stack([torch.cat([padding[0, :3], short_prompt]), long_prompt])
            batch_mask = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), torch.ones(4, dtype=torch.long)]),
                                      torch.ones(7, dtype=torch.long)])
            kwargs = dict(do_sample=False, output_logits=True, output_scores=True, return_dict_in_generate=True,
                          max_new_tokens=4)
            batch = self._generate(model, {"input_ids": batch_ids, "attention_mask": batch_mask}, **kwargs)
            for row, prompt in enumerate((short_prompt, long_prompt)):
                alone_inputs = {"input_ids": prompt[None], "attention_mask": torch.ones_like(prompt)[None]}
                alone = self._generate(model, alone_inputs, **kwargs)
                self.assertTrue(torch.equal(batch.sequences[row, -4:], alone.sequences[0, -4:]), f"row {row}")
                for step in range(4):
                    torch.testing.assert_close(batch.logits[step][row], alone.logits[step][0], rtol=RTOL, atol=ATOL)

    @pytest.mark.generate
    def test_past_key_values_format(self):
        """A forward with ``use_cache=True`` returns a ``DynamicCache`` (not legacy tuples) of one layer per decoder
        layer, keys and values [B, num_key_value_heads, T, head_dim]."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            model = self._model(model_class, config)
            with torch.no_grad():
                outputs = model(**inputs, use_cache=True)
            batch_size, length = inputs["input_ids"].shape
            self._check_cache(outputs.cache, config, batch_size, length)

    @pytest.mark.generate
    def test_generate_from_inputs_embeds(self):
        """upstream's (greedy and beam search): generating from ``inputs_embeds`` equals generating from the ids;
        other embeddings give other scores; without ids the new tokens are the same."""
        for model_class in self.all_generative_model_classes:
            for num_beams in (1, 2):
                config, inputs = self.prepare_config_and_inputs_for_generate()
                model = self._model(model_class, config)
                input_ids = inputs.pop("input_ids")
                kwargs = dict(return_dict_in_generate=True, output_scores=True, num_beams=num_beams, do_sample=False,
                              max_new_tokens=5, min_new_tokens=5, **inputs)
                from_ids = self._generate(model, {"input_ids": input_ids}, **kwargs)
                embeds = model.get_input_embeddings()(input_ids)
                from_embeds = self._generate(model, {"input_ids": input_ids, "inputs_embeds": embeds}, **kwargs)
                self._check_similar_generate_outputs(from_ids, from_embeds)
                random = self._generate(model, {"input_ids": input_ids, "inputs_embeds": torch.rand_like(embeds)},
                                        **kwargs)
                for step in range(len(random.scores)):
                    self.assertFalse(torch.allclose(from_embeds.scores[step], random.scores[step]))
                without_ids = self._generate(model, {"inputs_embeds": embeds}, **kwargs)
                from_embeds.sequences = from_embeds.sequences[:, embeds.shape[1]:]
                self._check_similar_generate_outputs(without_ids, from_embeds)

    @pytest.mark.generate
    def test_generate_continue_from_past_key_values(self):
        """Generating 3 tokens, then 3 more from the returned cache, equals generating 6 at once."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            kwargs = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, use_cache=True)
            at_once = self._generate(model, inputs, max_new_tokens=6, **kwargs)
            first = self._generate(model, inputs, max_new_tokens=3, **kwargs)
            self.assertIsInstance(first.cache, DynamicCache)
            mask = torch.ones_like(first.sequences)
            second = self._generate(model, {"input_ids": first.sequences, "attention_mask": mask},
                                    cache=first.cache, max_new_tokens=3, **kwargs)
            self.assertTrue(torch.equal(second.sequences, at_once.sequences))
            for step in range(3):
                torch.testing.assert_close(second.scores[step], at_once.scores[3 + step], rtol=RTOL, atol=ATOL)

    @pytest.mark.generate
    def test_generate_with_static_cache(self):
        """``cache_implementation="static"`` (eager: no compilation on the CPU) returns a ``StaticCache`` sized to
        prompt + new tokens - 1 (the last token is never fed back) and decodes what the dynamic cache decodes, with
        the same logits."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            kwargs = dict(do_sample=False, return_dict_in_generate=True, output_logits=True, output_scores=True,
                          max_new_tokens=4)
            dynamic = self._generate(model, inputs, **kwargs)
            static = self._generate(model, inputs, cache_implementation="static", **kwargs)
            prompt_length = inputs["input_ids"].shape[1]
            self._check_cache(static.cache, config, 2, prompt_length + 3, cache_class=StaticCache)
            self.assertEqual(static.cache.get_max_length(), prompt_length + 4 - 1)
            self.assertTrue(torch.equal(static.sequences, dynamic.sequences))
            for step in range(4):
                torch.testing.assert_close(static.logits[step], dynamic.logits[step], rtol=RTOL, atol=ATOL)

    @pytest.mark.generate
    def test_generate_methods_with_logits_to_keep(self):
        """Generation computes only the last position's logits (``logits_to_keep``) and decodes the same as a
        forward that keeps all of them."""
        for model_class in self.all_generative_model_classes:
            if "logits_to_keep" not in inspect.signature(model_class.forward).parameters:
                self.fail(f"{model_class.__name__}.forward has no logits_to_keep")  # every family inherits Llama's
            config, inputs = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            with torch.no_grad():
                last = model(**inputs, logits_to_keep=1).logits
                every = model(**inputs, logits_to_keep=0).logits
            self.assertEqual(last.shape[1], 1)
            torch.testing.assert_close(last[:, 0], every[:, -1], rtol=RTOL, atol=ATOL)
            with_keep = self._generate(model, inputs, do_sample=False, max_new_tokens=5)
            without = self._generate(model, inputs, do_sample=False, max_new_tokens=5, logits_to_keep=0)
            self.assertTrue(torch.equal(with_keep, without))

    # ----------------------------------------------------------------------------------------------------------
    # Assisted decoding and prompt lookup
    # ----------------------------------------------------------------------------------------------------------

    @pytest.mark.generate
    def test_assisted_decoding_matches_greedy_search(self):
        """The model as its own assistant decodes exactly what greedy search decodes, with the same logits."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate(batch_size=1)
            model = self._model(model_class, config)
            assistant = self._model(model_class, config)
            assistant.load_state_dict(model.state_dict())
            assistant.generation_config.num_assistant_tokens = 2
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            kwargs = dict(do_sample=False, num_beams=1, max_new_tokens=6, output_scores=True, output_logits=True,
                          return_dict_in_generate=True, use_cache=True)
            greedy = self._generate(model, inputs, **kwargs)
            assisted = self._generate(model, inputs, assistant_model=assistant, **kwargs)
            self.assertTrue(torch.equal(assisted.sequences, greedy.sequences))
            for step in range(6):
                torch.testing.assert_close(assisted.logits[step], greedy.logits[step], rtol=RTOL, atol=ATOL)
            self._check_logits_equal_full_forward(model, assisted, inputs["input_ids"].shape[1])

    @pytest.mark.generate
    def test_prompt_lookup_decoding_matches_greedy_search(self):
        """Prompt lookup (candidates copied from the prompt, verified several tokens per forward) decodes exactly what
        greedy search decodes. The prompt repeats itself, so candidates are found and accepted."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate(batch_size=1)
            model = self._model(model_class, config)
            repeated = inputs["input_ids"].repeat(1, 2)
            inputs = {"input_ids": repeated, "attention_mask": torch.ones_like(repeated)}
            kwargs = dict(do_sample=False, num_beams=1, max_new_tokens=6, output_scores=True, output_logits=True,
                          return_dict_in_generate=True, use_cache=True)
            greedy = self._generate(model, inputs, **kwargs)
            lookup = self._generate(model, inputs, prompt_lookup_num_tokens=2, max_matching_ngram_size=2, **kwargs)
            self.assertTrue(torch.equal(lookup.sequences, greedy.sequences))
            for step in range(6):
                torch.testing.assert_close(lookup.logits[step], greedy.logits[step], rtol=RTOL, atol=ATOL)
            # With greedy's third new token as eos, both stop there (no candidate token is accepted past it).
            eos = int(greedy.sequences[0, repeated.shape[1] + 2])
            stop_kwargs = dict(kwargs, eos_token_id=eos, pad_token_id=config.pad_token_id)
            greedy_eos = self._generate(model, inputs, **stop_kwargs)
            lookup_eos = self._generate(model, inputs, prompt_lookup_num_tokens=2, max_matching_ngram_size=2,
                                        **stop_kwargs)
            self.assertTrue(torch.equal(lookup_eos.sequences, greedy_eos.sequences))
            self.assertLessEqual(greedy_eos.sequences.shape[1], repeated.shape[1] + 3)
            self.assertEqual(int(greedy_eos.sequences[0, -1]), eos)

    @pytest.mark.generate
    def test_assisted_decoding_sample(self):
        """Sampling with the model as its own assistant: seeded runs repeat, the output has one score per new token
        and every step's raw logits are the model's."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.prepare_config_and_inputs_for_generate(batch_size=1)
            model = self._model(model_class, config)
            assistant = self._model(model_class, config)
            assistant.load_state_dict(model.state_dict())
            assistant.generation_config.num_assistant_tokens = 2
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            kwargs = dict(do_sample=True, num_beams=1, use_cache=True, output_scores=True, output_logits=True,
                          return_dict_in_generate=True,
                          assistant_model=assistant, **self._logits_processor_kwargs(do_sample=True))
            torch.manual_seed(0)
            first = self._generate(model, inputs, **kwargs)
            torch.manual_seed(0)
            second = self._generate(model, inputs, **kwargs)
            self.assertTrue(torch.equal(first.sequences, second.sequences))
            self.assertEqual(first.sequences.shape, (1, inputs["input_ids"].shape[1] + self.max_new_tokens))
            self.assertEqual(len(first.scores), self.max_new_tokens)
            self._check_logits_equal_full_forward(model, first, inputs["input_ids"].shape[1])
