#!/usr/bin/env bash
# 04_perl.sh — proves perl (Debian's perl uses the system malloc) runs
# unchanged with hakmem preloaded: generated text pushed through regexes
# (captures, substitutions, tr, global matches), hashes of arrays, sort with
# custom comparators, split/join, sprintf/pack, string growth and many freed
# and rebuilt structures. The printed MD5 digests, stdout and exit status must
# be identical with and without LD_PRELOAD.
#
# Env: LIB = absolute path of libhakmem.so (required); WORK = scratch dir
# (optional). Exit 0 pass, 77 skip (perl missing), anything else = fail.
name=04_perl
. "$(dirname "$0")/lib/common.sh" || exit 1
need_cmd perl
perl -MDigest::MD5 -e1 >/dev/null 2>&1 || skip "perl Digest::MD5 not available"
setup_scratch 60

cat > "$T/work.pl" <<'PL'
use strict; use warnings; use Digest::MD5 qw(md5_hex);
my $ctx = Digest::MD5->new;
sub feed { $ctx->add(join("\x1f", map { defined $_ ? $_ : "<undef>" } @_), "\n") }
# deterministic PRNG (don't depend on perl's rand implementation)
my $s = 987654321;
sub rnd { $s = ($s * 69069 + 1) % 4294967296; return $s >> 8 }
my @syl = qw(ka lo mi nu re sa ti vo xe zu qua ber din fol gar hen ips jot);

# 1. generate text: 40k lines of words and numbers
my @lines;
for my $i (1 .. 40000) {
    my $n = 3 + rnd() % 12;
    my @w = map { join '', map { $syl[rnd() % @syl] } 1 .. (1 + rnd() % 4) } 1 .. $n;
    push @lines, sprintf("%06d %s = %d.%03d [%s]", $i, join(' ', @w), rnd() % 100000, rnd() % 1000, join(',', map { rnd() % 97 } 1 .. ($i % 6)));
}
my $text = join("\n", @lines) . "\n";
feed(length $text, md5_hex($text));

# 2. regexes: captures, global matches, substitutions, tr
my (%freq, %bylen, $sum);
for my $l (@lines) {
    if ($l =~ /^(\d+) (.*?) = (\d+)\.(\d+) \[([\d,]*)\]$/) {
        $sum += $3 * 1000 + $4;
        for my $w (split / /, $2) { $freq{$w}++; push @{ $bylen{length $w} }, $w if $freq{$w} == 1 }
        my @nums = split /,/, $5; $sum += $_ for @nums;
    } else { die "no match: $l" }
}
my @caps = ($text =~ /\b(qua\w*ber)\b/g);
feed($sum, scalar(keys %freq), scalar(@caps));
(my $t2 = $text) =~ s/(\d+)\.(\d+)/sprintf("%x:%s", $1, scalar reverse $2)/ge;
$t2 =~ s/\b([a-z])([a-z]*)\b/\u$1\L$2/g;
(my $t3 = $t2) =~ tr/a-zA-Z/n-za-mN-ZA-M/;
feed(length $t2, md5_hex($t2), md5_hex($t3));
my $vowels = ($text =~ tr/aeiou//);
feed($vowels);

# 3. hashes: build, delete half, rebuild with different sizes, nested data
my %h;
for my $round (1 .. 3) {
    for my $i (0 .. 60000) { $h{"k$round-" . ($i * 2654435761 % 1000003)} = [ $i, "v" x ($i % 50), { r => $round } ] }
    my @ks = sort keys %h;
    delete @h{ @ks[ grep { $_ % 2 } 0 .. $#ks ] };
    feed($round, scalar(keys %h), $ks[0], $ks[-1]);
}
my $acc = 0; $acc = ($acc * 33 + $h{$_}[0] + length($h{$_}[1])) % 1000000007 for sort keys %h;
feed($acc);
undef %h;

# 4. sort: numeric, multi-key, Schwartzian transform
my @top = (sort { $freq{$b} <=> $freq{$a} || $a cmp $b } keys %freq)[0 .. 29];
feed(map { "$_=$freq{$_}" } @top);
my @st = map { $_->[1] } sort { $a->[0] <=> $b->[0] or $a->[1] cmp $b->[1] } map { [ length($_), $_ ] } keys %freq;
feed(scalar(@st), @st[0 .. 9], @st[-10 .. -1]);
feed(map { "$_:" . scalar(@{ $bylen{$_} }) } sort { $a <=> $b } keys %bylen);

# 5. split/join, sprintf, pack/unpack, string growth and shrink
my $big = '';
for my $i (1 .. 100000) {
    $big .= sprintf("%05d|%-8s|%+.3e;", $i, $syl[$i % @syl] x (1 + $i % 3), $i / 7);
    substr($big, 0, 20000, '') if length($big) > 200000;
}
my @f = split /[|;]/, $big;
feed(length $big, scalar(@f), md5_hex(join '#', reverse @f));
my $packed = pack('N*', map { rnd() } 1 .. 50000);
my @un = unpack('N*', $packed);
my $x = 0; $x ^= $_ for @un;
feed(length $packed, $x, md5_hex($packed));

# 6. many small arrays and strings freed and rebuilt
for my $round (1 .. 5) {
    my @objs = map { { id => $_, name => "obj$_" x (1 + $_ % 4), list => [ 1 .. ($_ % 20) ] } } 1 .. 40000;
    @objs = grep { $_->{id} % 3 } @objs;
    my $c = 0; $c += @{ $_->{list} } + length $_->{name} for @objs;
    feed($round, scalar(@objs), $c);
}
print "perl-workload ", $ctx->hexdigest, "\n";
PL

run() {   # run plain|pre
  local tag=$1
  if [ "$tag" = pre ]; then
    ( cd "$T" && env PERL_HASH_SEED=0 PERL_PERTURB_KEYS=0 LD_PRELOAD="$LIB" $TO perl work.pl >"$tag.out" 2>"$tag.err" ); echo $? >"$T/$tag.rc"
  else
    ( cd "$T" && env PERL_HASH_SEED=0 PERL_PERTURB_KEYS=0 $TO perl work.pl >"$tag.out" 2>"$tag.err" ); echo $? >"$T/$tag.rc"
  fi
}
run plain; run pre
p=plain q=pre
check_preloaded_stderr "$q"
check_served "$T/$q.err" 1500000   # measured: 3.8M
check_plain_rc "$p" "test bug or broken perl"
[ -s "$T/$p.out" ] || fail "plain run printed nothing" "$T/$p.err"
check_same "$p" "$q"
echo "$name: PASS ($(cat "$T/$p.out"))"
exit 0
