"""The real-word fraction the demo prints: word splitting, case folding, and the training vocabulary."""
from hpctrain.sample_words import real_word_fraction, training_vocabulary, words


def test_words_are_letter_runs_of_three_or_more_case_folded():
    assert words("ROMEO: O, Romeo! wherefore art thou--Romeo? 1594 a_b x-ray") == [
        "romeo", "romeo", "wherefore", "art", "thou", "romeo", "ray"]


def test_fraction_counts_each_occurrence():
    vocab = {"romeo", "thou", "art"}
    assert real_word_fraction("Romeo, thou art thake wis mathe", vocab) == (3 / 6, 6)
    assert real_word_fraction("O! I, a 42", vocab) == (0.0, 0)


def test_training_vocabulary_reads_only_the_training_split(tmp_path):
    from data_tools.__main__ import main as data_main

    train = tmp_path / "train.txt"
    train.write_text("Now is the winter of our discontent\n" * 50)
    held_out = tmp_path / "zzz.txt"
    held_out.write_text("Unseen heldout quokka\n")
    out = tmp_path / "ds"
    assert data_main(["shard", "--input", str(train), str(held_out), "--output", str(out),
                      "--tokenizer", "bytes", "--val-fraction", "0.5", "--seed", "1"]) in (0, None)
    # one document goes to each split (which one: the seed's choice); only the training one counts
    assert training_vocabulary(str(out)) in ({"now", "the", "winter", "our", "discontent"},
                                             {"unseen", "heldout", "quokka"})
