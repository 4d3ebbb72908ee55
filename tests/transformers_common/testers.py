"""Model testers in the shape of transformers' ``tests/causal_lm_tester.py`` and its Llama tester, for our families.

``DecoderModelTester`` builds a tiny config of one decoder family and variant and its inputs (the attributes that
transformers' ``ModelTesterMixin`` reads: ``batch_size``, ``seq_length``, ``hidden_size``, ...); ``CausalLMModelTest``
is the base of every decoder test class (one per family and variant, Llama as the control), with the tests the
upstream ``CausalLMModelTest`` adds to the common suite (``test_config``, ``test_model``, ...).

Every decoder tester uses the same shapes, so Llama, the control, runs at the shapes of our families.
"""

import torch
from transformers import DynamicCache

# upstream's causal-LM tester shapes (2 layers: the common suite's test_num_layers_is_small allows no more) with GQA
# (4 query / 2 KV heads) and Llama's activation. Ids 0-2 are pad / bos / eos.
DECODER_SHAPES = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=37,
    hidden_act="silu",
    max_position_embeddings=512,
    initializer_range=0.02,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def ids_tensor(shape: list[int], vocab_size: int, low: int = 0) -> torch.Tensor:
    """Random token ids in ``[low, vocab_size)`` of ``shape`` (drawn from torch's global generator, seeded per test)."""
    return torch.randint(low, vocab_size, tuple(shape), dtype=torch.long)


class DecoderModelTester:
    """Tiny config and inputs of one decoder family and variant (upstream's ``CausalLMModelTester``).

    Class attributes set per family: ``config_class``, ``base_model_class``, ``causal_lm_class`` and
    ``family_options`` (the variant's own config fields, e.g. ``{"dwa_dilation": 2, "dwa_period": 2}``).
    """

    config_class = None
    base_model_class = None
    causal_lm_class = None
    family_options: dict = {}

    def __init__(self, parent, batch_size: int = 13, seq_length: int = 7, is_training: bool = True,
                 use_input_mask: bool = True, use_labels: bool = True, **shapes):
        for name in ("config_class", "base_model_class", "causal_lm_class"):
            if getattr(self, name) is None:
                raise ValueError(f"{type(self).__name__} must set `{name}`")
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_input_mask = use_input_mask
        self.use_labels = use_labels
        self.config_kwargs = {**DECODER_SHAPES, **shapes, **self.family_options}
        for name, value in self.config_kwargs.items():
            setattr(self, name, value)
        self.head_dim = self.hidden_size // self.num_attention_heads

    def get_config(self):
        return self.config_class(**self.config_kwargs)

    def prepare_config_and_inputs(self):
        # Ids from 3 up: the tests that pad (left padding, eager vs SDPA) must not meet pad / bos / eos by chance.
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size, low=3)
        input_mask = torch.tril(torch.ones(self.batch_size, self.seq_length, dtype=torch.long)) \
            if self.use_input_mask else None
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size) if self.use_labels else None
        return self.get_config(), input_ids, input_mask, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}

    def create_and_check_model(self, config, input_ids, input_mask, token_labels):
        model = self.base_model_class(config).eval()
        with torch.no_grad():
            masked = model(input_ids, attention_mask=input_mask)
            result = model(input_ids)
        shape = (self.batch_size, self.seq_length, self.hidden_size)
        self.parent.assertEqual(masked.last_hidden_state.shape, shape)
        self.parent.assertEqual(result.last_hidden_state.shape, shape)

    def create_and_check_for_causal_lm(self, config, input_ids, input_mask, token_labels):
        model = self.causal_lm_class(config).eval()
        with torch.no_grad():
            result = model(input_ids, attention_mask=input_mask, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))
        expected = torch.nn.functional.cross_entropy(result.logits[:, :-1].reshape(-1, self.vocab_size),
                                                     token_labels[:, 1:].reshape(-1))
        torch.testing.assert_close(result.loss, expected)

    def create_and_check_decoder_model_past_large_inputs(self, config, input_ids, input_mask, token_labels):
        """Upstream's check: a 3-token step on the cache of a prefill equals the full forward's last 3 positions
        (here every position and the logits, to float32 rounding)."""
        model = self.causal_lm_class(config).eval()
        mask = torch.ones_like(input_ids)
        next_tokens = ids_tensor([self.batch_size, 3], self.vocab_size, low=3)
        full_ids = torch.cat([input_ids, next_tokens], dim=-1)
        with torch.no_grad():
            cache = DynamicCache(config=config)
            model(input_ids, attention_mask=mask, cache=cache, use_cache=True)
            step = model(next_tokens, attention_mask=torch.ones_like(full_ids), cache=cache, use_cache=True,
                         output_hidden_states=True)
            full = model(full_ids, attention_mask=torch.ones_like(full_ids), output_hidden_states=True)
        self.parent.assertEqual(cache.get_seq_length(), full_ids.shape[1])
        torch.testing.assert_close(step.hidden_states[-1], full.hidden_states[-1][:, -3:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step.logits, full.logits[:, -3:], rtol=1e-5, atol=1e-5)


class Qwen3BackboneTester:
    """Put before a family's tester: the family on a Qwen3 backbone (issue 30; q/k norms, an explicit head_dim), at
    the same shapes, given in ``backbone_config``."""

    def get_config(self):
        from transformers import Qwen3Config

        shapes = {k: v for k, v in self.config_kwargs.items() if k not in self.family_options}
        return self.config_class(backbone_config=Qwen3Config(**shapes, head_dim=self.head_dim), **self.family_options)


class CausalLMModelTest:
    """The tests upstream's ``CausalLMModelTest`` adds to ``ModelTesterMixin`` for a decoder, minus those for heads
    our families do not have (sequence / token classification, question answering) and the pipeline mixin (it
    needs a tokenizer from the Hub). A test class sets ``model_tester_class`` and inherits, in this order, from
    this class, transformers' ``ModelTesterMixin``, our ``GenerationTesterMixin`` and ``unittest.TestCase``."""

    model_tester_class = None
    config_tester_class = None  # transformers' ConfigTester, set by the test module (it is loaded at test time)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        tester = cls.model_tester_class
        if tester is not None:
            cls.all_model_classes = (tester.base_model_class, tester.causal_lm_class)

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        self.config_tester = self.config_tester_class(self, config_class=self.model_tester.config_class,
                                                      **self.model_tester.config_kwargs)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_for_causal_lm(self):
        self.model_tester.create_and_check_for_causal_lm(*self.model_tester.prepare_config_and_inputs())

    def test_decoder_model_past_with_large_inputs(self):
        self.model_tester.create_and_check_decoder_model_past_large_inputs(*self.model_tester.prepare_config_and_inputs())


# The DWAtt backbone: upstream's BERT tester shapes (2 layers).
ENCODER_SHAPES = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    hidden_act="gelu",
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    max_position_embeddings=512,
    type_vocab_size=16,
    initializer_range=0.02,
)


class TokenClassificationModelTester:
    """Tiny config and inputs of a token-classification model over a BERT-shaped encoder (upstream's BERT tester
    shapes). Set ``model_class`` and ``get_config``; ``config_kwargs`` are the ConfigTester's arguments."""

    model_class = None
    config_kwargs: dict = {}

    def __init__(self, parent, batch_size: int = 13, seq_length: int = 7, is_training: bool = True,
                 use_input_mask: bool = True, use_labels: bool = True, num_labels: int = 3):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_input_mask = use_input_mask
        self.use_labels = use_labels
        self.num_labels = num_labels
        for name, value in ENCODER_SHAPES.items():
            setattr(self, name, value)

    def get_config(self):
        raise NotImplementedError

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size, low=3)
        input_mask = torch.tril(torch.ones(self.batch_size, self.seq_length, dtype=torch.long)) \
            if self.use_input_mask else None
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels) if self.use_labels else None
        return self.get_config(), input_ids, input_mask, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}

    def create_and_check_for_token_classification(self, config, input_ids, input_mask, token_labels):
        model = self.model_class(config).eval()
        with torch.no_grad():
            result = model(input_ids, attention_mask=input_mask, labels=token_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.num_labels))
        expected = torch.nn.functional.cross_entropy(result.logits.reshape(-1, self.num_labels),
                                                     token_labels.reshape(-1))
        torch.testing.assert_close(result.loss, expected)


class TokenClassificationModelTest:
    """The tests upstream's BERT test adds for its token-classification head (``test_config``,
    ``test_for_token_classification``). Inherit, in this order, from this class, ``ModelTesterMixin`` and
    ``unittest.TestCase`` (no generation mixin: the model cannot generate)."""

    model_tester_class = None
    config_tester_class = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.model_tester_class is not None:
            cls.all_model_classes = (cls.model_tester_class.model_class,)

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        self.config_tester = self.config_tester_class(self, config_class=type(self.model_tester.get_config()),
                                                      **self.model_tester.config_kwargs)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_for_token_classification(self):
        self.model_tester.create_and_check_for_token_classification(*self.model_tester.prepare_config_and_inputs())
