"""Other tools' formats: nccl-tests alltoallv matrices, each dispatcher's own bandwidth figures."""
