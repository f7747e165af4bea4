"""The torch.compile backend: insertion of communication, partitioning, final compile."""
