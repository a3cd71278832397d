"""Data the package ships for its default run: a 512-question GSM8K training sample and a
256-question test sample (MIT, see GSM8K_LICENSE)."""
