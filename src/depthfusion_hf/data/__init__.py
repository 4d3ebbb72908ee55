"""Data utilities: CoNLL/IOB reading, few-shot sampling, WNUT-16 splits, Hub NER sets, label alignment."""

from .alignment import align_first_subword, build_label_list, tokenize_and_align, word_predictions
from .conll import ConllFormatError, read_conll, to_iob2
from .documents import read_json_documents, read_local_file, read_text_documents, split_paragraphs
from .fewshot import TrainingSize, check_pool, count_entities, parse_size, sample_kshot, sample_sentences
from .hub import load_hub_ner, sentences_from_hf_split
from .textfile import DataFormatError, check_data_file, package_file, read_json_file, read_text
from .wnut import load_wnut16, wnut16_path

__all__ = ["ConllFormatError", "DataFormatError", "TrainingSize", "align_first_subword", "build_label_list",
           "check_data_file", "check_pool", "count_entities", "load_hub_ner", "load_wnut16", "package_file",
           "parse_size", "read_conll", "read_json_documents", "read_json_file", "read_local_file", "read_text",
           "read_text_documents", "sample_kshot", "sample_sentences", "sentences_from_hf_split", "split_paragraphs",
           "to_iob2", "tokenize_and_align", "wnut16_path", "word_predictions"]
