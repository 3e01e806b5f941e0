//! Statements that stay prepared on their connection: the claim's SQL text ([`Prepared`]) and
//! the fenced writes built with the query builder ([`KeepPrepared`]).
//!
//! Diesel puts neither `diesel::sql_query` nor any `diesel::update` in the statement cache:
//! every run parses and describes its text again, a round trip of its own before the one that
//! executes. The claim and the fenced writes run the same few texts thousands of times a second,
//! so they go through these two instead: diesel-async prepares each text once per connection
//! (keyed by the SQL and its bind types) and later runs cost one round trip.
//!
//! Planning still happens on every run: the pool sets `plan_cache_mode = force_custom_plan`
//! (see [`super::connect_pool`]), so PostgreSQL plans each execution with its real values (the
//! claim's `now()` and `LIMIT`, the finalize's array sizes) instead of switching to a generic
//! plan after five runs.

use std::marker::PhantomData;

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{HasSqlType, Untyped};

/// A statement of the query builder that diesel-async keeps prepared, keyed by its SQL text and
/// bind types: see [`keep_prepared`].
#[must_use = "a statement runs only when loaded or executed"]
pub(crate) struct KeepPrepared<Q>(Q);

/// Lets `query` stay prepared on its connection.
///
/// Diesel marks every `UPDATE` unsafe to cache because a derived `AsChangeset` skips its `None`
/// fields, so one statement type can produce many texts. Only wrap a statement whose text
/// depends on its type alone: a `SET` of a tuple of assignments (no optional ones), array
/// binds for batches (`= ANY($1)`, the fence expressions), no `sql` literal. A statement that
/// broke this would stay correct (the cache is keyed by the text) but fill the cache with one
/// statement per text; the test `claim_and_finalize_stay_prepared_and_never_run_on_a_generic_plan`
/// counts the statements of every fenced write.
pub(crate) fn keep_prepared<Q>(query: Q) -> KeepPrepared<Q> {
    KeepPrepared(query)
}

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for KeepPrepared<Q> {
    fn walk_ast<'b>(&'b self, out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.0.walk_ast(out)
    }

    fn is_safe_to_cache_prepared(&self, _backend: &Pg) -> QueryResult<bool> {
        Ok(true)
    }
}

impl<Q: QueryId> QueryId for KeepPrepared<Q> {
    type QueryId = KeepPrepared<Q::QueryId>;
    const HAS_STATIC_QUERY_ID: bool = Q::HAS_STATIC_QUERY_ID;
}

impl<Q: Query> Query for KeepPrepared<Q> {
    type SqlType = Q::SqlType;
}

/// A fixed SQL text with typed binds, safe for diesel's prepared-statement cache.
///
/// The text refers to its binds as `$1`, `$2`, ... and may use one several times; each use
/// becomes a placeholder of its own with a copy of the value, so diesel sees placeholders in
/// order. The text must not contain `$` anywhere else (no dollar quoting, no `$` in literals).
#[must_use = "a statement runs only when loaded or executed"]
pub(crate) struct Prepared<'a> {
    sql: &'a str,
    binds: Vec<Box<dyn QueryFragment<Pg> + Send + 'a>>,
}

/// Starts a statement of `sql`; add its binds in order with [`Prepared::bind`].
pub(crate) fn prepared(sql: &str) -> Prepared<'_> {
    Prepared { sql, binds: Vec::new() }
}

impl<'a> Prepared<'a> {
    /// Adds the value of the next `$n`, as SQL type `ST`.
    pub(crate) fn bind<ST, U>(mut self, value: U) -> Self
    where
        Pg: HasSqlType<ST>,
        U: ToSql<ST, Pg> + Send + 'a,
        ST: 'a,
    {
        self.binds.push(Box::new(Bind { value, sql_type: PhantomData::<fn() -> ST> }));
        self
    }
}

struct Bind<ST, U> {
    value: U,
    sql_type: PhantomData<fn() -> ST>,
}

impl<ST, U> QueryFragment<Pg> for Bind<ST, U>
where
    Pg: HasSqlType<ST>,
    U: ToSql<ST, Pg>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_bind_param::<ST, U>(&self.value)
    }
}

impl QueryFragment<Pg> for Prepared<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let mut rest: &'b str = self.sql;
        while let Some(at) = rest.find('$') {
            let digits = rest[at + 1..].bytes().take_while(u8::is_ascii_digit).count();
            let number: usize = rest[at + 1..at + 1 + digits].parse().map_err(|_| unnumbered(self.sql))?;
            let bind = number
                .checked_sub(1)
                .and_then(|i| self.binds.get(i))
                .ok_or_else(|| unbound(number, self.binds.len()))?;
            out.push_sql(&rest[..at]);
            bind.walk_ast(out.reborrow())?;
            rest = &rest[at + 1 + digits..];
        }
        out.push_sql(rest);
        Ok(())
    }
}

fn unnumbered(sql: &str) -> diesel::result::Error {
    diesel::result::Error::QueryBuilderError(format!("a `$` not followed by a bind number in: {sql}").into())
}

fn unbound(number: usize, bound: usize) -> diesel::result::Error {
    diesel::result::Error::QueryBuilderError(format!("${number} used but {bound} values bound").into())
}

impl QueryId for Prepared<'_> {
    // Keyed by the SQL text and bind types, not by type: every statement shares this type.
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for Prepared<'_> {
    type SqlType = Untyped;
}

#[cfg(test)]
mod tests {
    use diesel::debug_query;
    use diesel::sql_types::{Int4, Text};

    use super::*;

    #[test]
    fn repeats_and_orders_placeholders() {
        let q = prepared("SELECT $2, $1, $2").bind::<Int4, _>(7).bind::<Text, _>("x");
        assert_eq!(debug_query::<Pg, _>(&q).to_string(), r#"SELECT $1, $2, $3 -- binds: ["x", 7, "x"]"#);
    }

    #[test]
    fn refuses_missing_binds() {
        let q = prepared("SELECT $1, $3").bind::<Int4, _>(7).bind::<Int4, _>(8);
        let mut sql = diesel::pg::PgQueryBuilder::default();
        assert!(matches!(q.to_sql(&mut sql, &Pg), Err(diesel::result::Error::QueryBuilderError(_))));
    }
}
