import pytest
import torch

from megatron_lowprec.data import build_gpt_datasets, prepare_dataset

SEQ_LENGTH = 32
NUM_SAMPLES = (64, 8, 8)


@pytest.fixture(scope="module")
def prepared(corpus_slice, tiny_byte_bpe, tmp_path_factory):
    return prepare_dataset([corpus_slice], tmp_path_factory.mktemp("prepared") / "slice", tiny_byte_bpe)


def _samples(dataset, count=8):
    return [dataset[i] for i in range(count)]


def test_splits_have_requested_samples_of_seq_length_plus_one(prepared, tiny_byte_bpe, tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDataset

    splits = build_gpt_datasets(prepared, tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, cache_dir=tmp_path)
    for dataset, requested in zip(splits, NUM_SAMPLES):
        assert isinstance(dataset, GPTDataset)
        assert dataset.num_samples == requested
        assert len(dataset) >= requested
        sample = dataset[requested - 1]
        assert sample["tokens"].shape == sample["labels"].shape == (SEQ_LENGTH,)
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ_LENGTH))
        assert torch.equal(sample["loss_mask"], torch.ones(SEQ_LENGTH))
        assert sample["attention_mask"].shape == (1, SEQ_LENGTH, SEQ_LENGTH)
        assert int(sample["tokens"].max()) < tiny_byte_bpe.vocab_size
    train, valid, test = splits
    assert train.indices.size > 50 * valid.indices.size
    assert set(train.indices).isdisjoint(valid.indices)
    assert list((tmp_path / "gpt_dataset_indices").glob("*.npy"))


def test_fixed_seed_is_deterministic(prepared, tiny_byte_bpe, tmp_path):
    first = build_gpt_datasets(prepared, tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, seed=7, cache_dir=tmp_path / "a")
    again = build_gpt_datasets(prepared, tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, seed=7, cache_dir=tmp_path / "b")
    other = build_gpt_datasets(prepared, tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, seed=8, cache_dir=tmp_path / "a")
    tokens = lambda dataset: torch.stack([s["tokens"] for s in _samples(dataset)])
    for split in range(3):
        assert torch.equal(tokens(first[split]), tokens(again[split]))
    assert not torch.equal(tokens(first[0]), tokens(other[0]))


def test_without_attention_mask_and_with_blend(prepared, tiny_byte_bpe, tmp_path):
    from megatron.core.datasets.blended_dataset import BlendedDataset

    train, _, _ = build_gpt_datasets(
        [prepared, prepared], tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, weights=[1, 3],
        cache_dir=tmp_path, create_attention_mask=False,
    )
    assert isinstance(train, BlendedDataset)
    assert len(train) == NUM_SAMPLES[0]
    assert "attention_mask" not in train[0]


def test_with_initialised_torch_distributed(prepared, tiny_byte_bpe, tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        train, valid, test = build_gpt_datasets(prepared, tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, cache_dir=tmp_path)
        assert train.num_samples == NUM_SAMPLES[0]
        assert train[0]["tokens"].shape == (SEQ_LENGTH,)
    finally:
        dist.destroy_process_group()


def test_bad_arguments_are_named(prepared, tiny_byte_bpe, tmp_path):
    with pytest.raises(ValueError, match="seq_length.*0"):
        build_gpt_datasets(prepared, tiny_byte_bpe, 0, NUM_SAMPLES, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"\(train, valid, test\).*\(64, 8\)"):
        build_gpt_datasets(prepared, tiny_byte_bpe, SEQ_LENGTH, (64, 8), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="'98/1/1'"):
        build_gpt_datasets(prepared, tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, split="98/1/1", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        build_gpt_datasets(str(tmp_path / "missing"), tiny_byte_bpe, SEQ_LENGTH, NUM_SAMPLES, cache_dir=tmp_path)
