"""kvrec: a shop ranker whose embedding tables live in our own feature store on ps0."""
