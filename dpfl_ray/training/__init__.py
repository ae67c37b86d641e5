"""What a client computes, with no Ray: models, local SGD, DP-SGD, batched training, evaluation."""
